"""K/V chunks outside a service's cache: their content-addressed keys and byte format (`chunks`)
and the chunk store (`store`: Redis or this process's memory) with its writer thread (`writer`).
No gRPC."""
