"""Imports point down and form no circle.

The layers, top to bottom: the command line (`specdec_cli`) composes the three apps
(`coordinator`, `draft_service`, `target_service`), which import none of each other, and
all of them stand on the shared library (`specdec`), which imports none of them. The import
graph here is read from the source with `ast`: every import, at module level or inside a
function, as a lazy import is a dependency all the same. The coordinator runs no model, so
none of its modules may bring torch into its process. Within the coordinator, each wing (api,
sources, policy, sessions; the round loop at the top) imports only what its docstring allows,
and only coordinator/session_calls.py records what a replica holds. Within the runtime, each
room (the contract and what the engines share at the bottom, a room per engine, the services'
plumbing, the factory at the top) imports only what its docstring allows: engines never import
each other, the contract imports no engine, the plumbing only the contract.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("specdec", "specdec_cli", "coordinator", "draft_service", "target_service")
APPS = ("coordinator", "draft_service", "target_service")
# what each package must not import (directly or lazily)
FORBIDDEN = {
    "specdec": {*APPS, "specdec_cli"},
    "specdec_cli": set(),
    **{app: {*APPS, "specdec_cli"} - {app} for app in APPS},
}


def module_files() -> dict[str, Path]:
    """Module name -> file, for every module of PACKAGES."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = module_files()


def _known(name: str) -> str | None:
    """The longest prefix of a dotted name that is one of our modules (None: not ours)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in MODULES:
            return candidate
    return None


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names, relative ones resolved against `module`."""
    if not node.level:
        return node.module or ""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def imports_of(module: str) -> set[str]:
    """The modules of ours that `module` imports; `from x import y` counts x.y where y is a module."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text(), str(MODULES[module]))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            names = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source
                     for alias in node.names]
        else:
            continue
        found.update(target for target in map(_known, names) if target and target != module)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _cycle_through(start: str, members: set[str]) -> list[str]:
    """A shortest import circle from `start` back to itself within `members`."""
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for successor in sorted(GRAPH[node] & members):
            if successor == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if successor not in came_from:
                came_from[successor] = node
                queue.append(successor)
    raise AssertionError(f"{start} is on no circle within {sorted(members)}")


def test_the_graph_sees_lazy_and_submodule_imports():
    """The parser itself: a lazy import counts, and `from package import module` names the module."""
    assert "coordinator.server" in GRAPH["specdec_cli.serve"]  # imported inside serve_coordinator
    assert "specdec.rpc.health" in GRAPH["specdec_cli.generate"]  # imported inside run
    assert "specdec_cli.generate" in GRAPH["specdec_cli.up"]  # from specdec_cli import generate
    assert "specdec.v1.common_pb2" in GRAPH["specdec.v1.coordinator_pb2"]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle(package):
    circles = []
    for component in _components(GRAPH):
        if any(module.split(".")[0] == package for module in component):
            circle = _cycle_through(component[0], set(component))
            circles.append(" -> ".join(circle) + ("" if len(component) == len(circle) - 1 else
                                                  f"  (one circle of {', '.join(component)})"))
    assert not circles, f"import circles through {package}:\n" + "\n".join(circles)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_down(package):
    upward = sorted(f"{module} imports {target}" for module, targets in GRAPH.items()
                    if module.split(".")[0] == package
                    for target in targets if target.split(".")[0] in FORBIDDEN[package])
    assert not upward, f"{package} must import none of {sorted(FORBIDDEN[package])}:\n" + "\n".join(upward)


# Imports the modules named on its command line in turn; after each that brought torch into
# sys.modules, prints the module and the chain of module-level imports that reached torch.
TORCH_PROBE = r"""
import importlib, sys

chains = []


class Probe:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            frame, chain = sys._getframe(1), ["torch"]
            while frame is not None:
                module = frame.f_globals.get("__name__", "")
                if frame.f_code.co_name == "<module>" and module not in ("__main__", chain[-1]):
                    chain.append(module)
                frame = frame.f_back
            chains.append(" -> ".join(reversed(chain)))
        return None


sys.meta_path.insert(0, Probe())
for name in sys.argv[1:]:
    importlib.import_module(name)
    if "torch" in sys.modules:
        print(f"{name}: {chains[-1] if chains else 'torch'}")
        break
"""


def _torch_importers(modules: list[str]) -> list[str]:
    result = subprocess.run([sys.executable, "-c", TORCH_PROBE, *modules], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, f"importing {modules} failed:\n{result.stderr}"
    return result.stdout.splitlines()


def test_no_coordinator_module_imports_torch():
    modules = sorted(module for module in MODULES if module.split(".")[0] == "coordinator")
    if not _torch_importers(modules):
        return
    # one fresh process per module, to name every module that brings torch in and how
    offenders = [line for module in modules for line in _torch_importers([module])]
    pytest.fail("torch is imported by these coordinator modules (module: import chain):\n"
                + "\n".join(offenders))


# The coordinator's wings (coordinator/__init__.py and each wing's docstring): what each may
# import of the coordinator. The round loop at the top (the coordinator's own top-level modules)
# may import every wing; only server.py, which composes everything, imports the APIs.
ROUND_RECORDS = {"coordinator.rounds", "coordinator.session_calls", "coordinator.tasks"}
TOP = {module for module, path in MODULES.items()
       if module.startswith("coordinator.") and path.parent == ROOT / "coordinator"}
WINGS = {
    "coordinator.sessions": {"coordinator.sessions"},
    "coordinator.policy": {"coordinator.policy"},
    "coordinator.sources": {"coordinator.policy", "coordinator.sessions", *ROUND_RECORDS},
    "coordinator.api": {"coordinator.api", *(TOP - {"coordinator.server"})},
}
# within sources: the interface, and a source's own parts; no source sees another
SOURCE_PARTS = {"coordinator.sources.draft_model": {"coordinator.sources.draft_ahead"},
                "coordinator.sources.prompt_lookup": {"coordinator.sources.lookup_index"}}


def _wing(module: str) -> str | None:
    return next((wing for wing in WINGS if module == wing or module.startswith(wing + ".")), None)


def _allowed(module: str, target: str) -> bool:
    """Whether coordinator `module` may import coordinator `target`."""
    wing = _wing(module)
    if wing is None:  # the round loop at the top
        return _wing(target) != "coordinator.api" or module == "coordinator.server"
    if wing == "coordinator.sources" and _wing(target) == wing:
        return target in {"coordinator.sources", "coordinator.sources.base", *SOURCE_PARTS.get(module, ())}
    return any(target == allowed or target.startswith(allowed + ".") for allowed in WINGS[wing])


def test_the_wings_exist_and_say_what_they_may_import():
    for wing in WINGS:
        doc = ast.get_docstring(ast.parse(MODULES[wing].read_text())) or ""
        assert "Decides:" in doc and "May import" in doc, f"{wing}/__init__.py must say what it decides and imports"
    assert "coordinator.round_loop" in TOP and "coordinator.server" in TOP


def test_coordinator_wings_import_only_what_they_may():
    crossed = sorted(f"{module} imports {target}" for module, targets in GRAPH.items()
                     if module.startswith("coordinator.")
                     for target in targets if target.startswith("coordinator.") and target != "coordinator"
                     and not _allowed(module, target))
    assert not crossed, "the coordinator's wings cross their bounds:\n" + "\n".join(crossed)


def test_the_wing_rules_can_fail():
    assert not _allowed("coordinator.sources.draft_model", "coordinator.sources.prompt_lookup")
    assert not _allowed("coordinator.policy.speculation", "coordinator.sources.lookup_index")
    assert not _allowed("coordinator.sessions.routing", "coordinator.rounds")
    assert not _allowed("coordinator.api.servicer", "coordinator.sessions.session_store")
    assert not _allowed("coordinator.round_loop", "coordinator.api.servicer")
    assert _allowed("coordinator.server", "coordinator.api.servicer")


def test_only_session_calls_records_what_a_replica_holds():
    """A session's held length on a replica has one owner (coordinator/session_calls.py)."""
    writers = sorted(module for module in MODULES if module.startswith("coordinator.")
                     for node in ast.walk(ast.parse(MODULES[module].read_text()))
                     if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                     and node.func.attr == "hold")
    assert set(writers) == {"coordinator.session_calls"}, f"record.hold(...) called in {writers}"



# what the model services may use of the runtime: the engine contract, the factory that builds an
# engine and the plumbing that runs calls on it (the per-round work is the engine's:
# specdec/runtime/engine.py)
SERVICE_RUNTIME = {"specdec.runtime.engine", "specdec.runtime.engines", "specdec.runtime.serving",
                   "specdec.runtime.serving.calls", "specdec.runtime.serving.scheduler",
                   "specdec.runtime.serving.worker"}


def test_the_model_services_call_only_the_engine_contract():
    used = sorted(f"{module} imports {target}" for module, targets in GRAPH.items()
                  if module.split(".")[0] in ("draft_service", "target_service")
                  for target in targets if target.startswith("specdec.runtime") and target not in SERVICE_RUNTIME)
    assert not used, "a model service reaches past the engine contract:\n" + "\n".join(used)


# The runtime's rooms (specdec/runtime/__init__.py and each room's docstring): the bottom (the
# runtime's own modules: the contract and what the engines share), a room per engine, the
# services' plumbing, and the factory at the top.
CONTRACT = "specdec.runtime.engine"
FACTORY = "specdec.runtime.engines"
ENGINE_ROOMS = ("specdec.runtime.torch", "specdec.runtime.llama_cpp", "specdec.runtime.graph")
SERVING = "specdec.runtime.serving"
BOTTOM = "specdec.runtime"
# what the contract may import of the runtime: the types its methods take
CONTRACT_TYPES = {"specdec.runtime.kv_cache", "specdec.runtime.session_kv"}


def _room(module: str) -> str | None:
    """The runtime room a module is in (BOTTOM for the runtime's own modules, FACTORY for the
    factory), None outside the runtime."""
    if module == FACTORY:
        return FACTORY
    for room in (*ENGINE_ROOMS, SERVING):
        if module == room or module.startswith(room + "."):
            return room
    return BOTTOM if module == BOTTOM or module.startswith(BOTTOM + ".") else None


def _runtime_allowed(module: str, target: str) -> bool:
    """Whether runtime `module` may import runtime `target`."""
    room, target_room = _room(module), _room(target)
    if module == CONTRACT:
        return target in CONTRACT_TYPES
    if room == FACTORY:
        return target_room != SERVING
    if room == SERVING:
        return target_room == SERVING or target == CONTRACT
    if room == BOTTOM:
        return target_room == BOTTOM
    return target_room in (room, BOTTOM)  # an engine: its own room and the bottom


def test_the_runtime_rooms_exist_and_say_what_they_may_import():
    for room in (BOTTOM, *ENGINE_ROOMS, SERVING):
        doc = ast.get_docstring(ast.parse(MODULES[room].read_text())) or ""
        assert "Decides:" in doc and "May import" in doc, f"{room}/__init__.py must say what it decides and imports"
    assert {CONTRACT, FACTORY, "specdec.runtime.torch.engine", "specdec.runtime.llama_cpp.engine",
            "specdec.runtime.graph.engine", "specdec.runtime.serving.calls"} <= set(MODULES)


def test_runtime_rooms_import_only_what_they_may():
    crossed = sorted(f"{module} imports {target}" for module, targets in GRAPH.items() if _room(module)
                     for target in targets if _room(target) and not _runtime_allowed(module, target))
    assert not crossed, "the runtime's rooms cross their bounds:\n" + "\n".join(crossed)


def test_the_runtime_room_rules_can_fail():
    assert not _runtime_allowed("specdec.runtime.graph.engine", "specdec.runtime.torch.batch_cache")
    assert not _runtime_allowed("specdec.runtime.torch.engine", "specdec.runtime.llama_cpp.engine")
    assert not _runtime_allowed("specdec.runtime.engine", "specdec.runtime.drafting")
    assert not _runtime_allowed("specdec.runtime.verification", "specdec.runtime.graph.device_verification")
    assert not _runtime_allowed("specdec.runtime.drafting", FACTORY)
    assert not _runtime_allowed("specdec.runtime.serving.calls", "specdec.runtime.torch.engine")
    assert not _runtime_allowed("specdec.runtime.serving.calls", "specdec.runtime.session_kv")
    assert not _runtime_allowed(FACTORY, "specdec.runtime.serving.worker")
    assert _runtime_allowed("specdec.runtime.serving.calls", CONTRACT)
    assert _runtime_allowed("specdec.runtime.graph.engine", "specdec.runtime.session_engine")
    assert _runtime_allowed(FACTORY, "specdec.runtime.llama_cpp.engine")


def test_no_module_is_over_500_lines():
    long = sorted(f"{path.relative_to(ROOT)}: {n} lines" for path in MODULES.values()
                  if "v1" not in path.parts and (n := len(path.read_text().splitlines())) > 500)
    assert not long, "modules over 500 lines:\n" + "\n".join(long)
