"""The benchmark suite's prompts: ten chat requests in five kinds.

Kinds: code generation (little to copy), code edit and rewrite/summarise (long spans of the
input come back), explanation (some quoting), multi-turn chat (an earlier answer revised).
Every prompt asks for an answer of well over 128 tokens. `QUICK` is one prompt per kind.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("code generation", "code edit", "rewrite/summarise", "explanation", "multi-turn chat")


@dataclass(frozen=True)
class Prompt:
    name: str
    kind: str
    messages: tuple[tuple[str, str], ...]  # (role, content), rendered with the chat template


SYSTEM = ("system", "You are a helpful assistant. Answer completely.")

INVENTORY_CODE = '''def load(path):
    items = []
    with open(path) as f:
        for line in f:
            name, qty, price = line.strip().split(",")
            items.append({"name": name, "qty": int(qty), "price": float(price)})
    return items


def total_value(items):
    total = 0
    for item in items:
        total += item["qty"] * item["price"]
    return total


def low_stock(items, threshold):
    result = []
    for item in items:
        if item["qty"] < threshold:
            result.append(item["name"])
    return result


def restock(items, name, amount):
    for item in items:
        if item["name"] == name:
            item["qty"] += amount
            return item
    raise KeyError(name)


def report(items):
    lines = []
    for item in sorted(items, key=lambda i: i["name"]):
        lines.append(f"{item['name']}: {item['qty']} x {item['price']:.2f}")
    lines.append(f"total: {total_value(items):.2f}")
    return "\\n".join(lines)
'''

ORDERS_CODE = '''function summarize(data) {
  const byCustomer = {};
  for (let i = 0; i < data.length; i++) {
    const row = data[i];
    if (!byCustomer[row.customer]) {
      byCustomer[row.customer] = { orders: 0, amount: 0 };
    }
    byCustomer[row.customer].orders += 1;
    byCustomer[row.customer].amount += row.amount;
  }
  const result = [];
  for (const customer in byCustomer) {
    result.push({ customer: customer, orders: byCustomer[customer].orders,
                  amount: byCustomer[customer].amount });
  }
  result.sort(function (a, b) { return b.amount - a.amount; });
  return result;
}

function topCustomers(data, n) {
  const summary = summarize(data);
  const top = [];
  for (let i = 0; i < n && i < summary.length; i++) {
    top.push(summary[i].customer);
  }
  return top;
}
'''

EMAIL = (
    "hey team, so basically the server thing last night was a mess. around 11pm the database "
    "ran out of disk space because the backup job didn't clean up the old snapshots like it was "
    "supposed to, and then the api started throwing 500s for about 40 minutes until Priya noticed "
    "the alerts and deleted a bunch of old files by hand. nobody lost any data as far as we can "
    "tell but a few customers did see errors when they tried to check out, maybe 200 orders "
    "failed and we need to email them. going forward i think we need to fix the cleanup script, "
    "add an alert when disk usage goes over 80 percent, and make sure someone is actually on call "
    "on weekends because this time it was just luck that Priya was awake. can everyone look at "
    "the doc i shared and add comments by thursday? also thanks Priya you saved us big time."
)

ARTICLE = (
    "Speculative decoding speeds up autoregressive generation without changing its output. A "
    "small draft model proposes several tokens, and the large target model checks all of them in "
    "a single forward pass. Because the target verifies a block of tokens at the cost of roughly "
    "one decoding step, every accepted draft token saves a full step of the large model. The "
    "acceptance rule compares the probability that each model assigns to the proposed token; a "
    "token is kept with probability equal to the ratio of the target's probability to the "
    "draft's, capped at one, and at the first rejection a replacement token is drawn from the "
    "normalized difference of the two distributions. This rule makes the output distribution "
    "exactly the target's. The speed-up depends on two numbers: the acceptance rate, which is "
    "high when the draft imitates the target well, and the cost ratio between a draft step and "
    "a target step. Prompt lookup is a draft-free variant: it proposes the tokens that followed "
    "an earlier occurrence of the latest few tokens in the context, which works remarkably well "
    "for editing, summarising and question answering over a given document, where the output "
    "copies long spans of the input."
)

QUICKSELECT = '''def quickselect(values, k):
    """Return the k-th smallest element (0-based)."""
    if not 0 <= k < len(values):
        raise IndexError(k)
    pivot = values[len(values) // 2]
    lows = [v for v in values if v < pivot]
    highs = [v for v in values if v > pivot]
    pivots = [v for v in values if v == pivot]
    if k < len(lows):
        return quickselect(lows, k)
    if k < len(lows) + len(pivots):
        return pivot
    return quickselect(highs, k - len(lows) - len(pivots))
'''

CHAT_CODE_ANSWER = '''Here is a function that computes the moving average of a list:

```python
def moving_average(values, window):
    averages = []
    for i in range(len(values) - window + 1):
        chunk = values[i:i + window]
        averages.append(sum(chunk) / window)
    return averages
```

It slides a window of the given size over the list and averages each chunk.'''

TRIP_PLAN = '''Day 1: Arrive in Lisbon, check in to the hotel in Baixa, walk along the Tagus river to Praça do Comércio, dinner in Alfama with fado music.
Day 2: Morning tram 28 to the Alfama and São Jorge Castle, afternoon in the LX Factory, sunset at the Miradouro da Senhora do Monte.
Day 3: Day trip to Sintra: Pena Palace in the morning, Quinta da Regaleira after lunch, back to Lisbon by train in the evening.
Day 4: Belém: the Jerónimos Monastery, the Belém Tower and pastéis de Belém, then the MAAT museum, farewell dinner in Bairro Alto.'''

PROMPTS = (
    Prompt("lru-cache", "code generation", (SYSTEM, (
        "user", "Write a Python class LRUCache with get(key) and put(key, value) methods that both "
                "run in O(1) time, using a dict and a doubly linked list. Include docstrings, type "
                "hints and a short usage example at the end."))),
    Prompt("duration-parser", "code generation", (SYSTEM, (
        "user", "Write a Python function parse_duration(text) that converts an ISO-8601 duration "
                "such as 'P3DT4H12M5S' into a number of seconds, raising ValueError on bad input. "
                "Then write pytest tests covering days, hours, minutes, seconds and invalid strings."))),
    Prompt("inventory-type-hints", "code edit", (SYSTEM, (
        "user", "Add type hints and a one-line docstring to every function in this Python module. "
                "Do not change the logic. Return the complete module.\n\n```python\n"
                + INVENTORY_CODE + "```"))),
    Prompt("orders-rename", "code edit", (SYSTEM, (
        "user", "In this JavaScript code rename the parameter `data` to `orders` everywhere and use "
                "`const` arrow functions instead of function declarations. Return the whole code.\n\n"
                "```javascript\n" + ORDERS_CODE + "```"))),
    Prompt("email-formal", "rewrite/summarise", (SYSTEM, (
        "user", "Rewrite the following email in a formal, professional tone. Keep every fact, "
                "name and number.\n\n" + EMAIL))),
    Prompt("article-summary", "rewrite/summarise", (SYSTEM, (
        "user", "Summarise the following text in six bullet points, quoting its key phrases "
                "verbatim where possible.\n\n" + ARTICLE))),
    Prompt("quickselect-explain", "explanation", (SYSTEM, (
        "user", "Explain step by step what this function does and why it works, quoting each "
                "line you discuss, then give its time complexity.\n\n```python\n" + QUICKSELECT + "```"))),
    Prompt("kv-cache-explain", "explanation", (SYSTEM, (
        "user", "Explain how a key-value cache speeds up text generation in transformer models, "
                "what it stores per layer, and how its memory grows with the sequence length."))),
    Prompt("moving-average-chat", "multi-turn chat", (
        SYSTEM,
        ("user", "Write a Python function that computes the moving average of a list."),
        ("assistant", CHAT_CODE_ANSWER),
        ("user", "Now make it handle an empty list and a window larger than the list, add type "
                 "hints and a docstring, and show the full function again with two examples."))),
    Prompt("trip-plan-chat", "multi-turn chat", (
        SYSTEM,
        ("user", "Plan four days in Lisbon for me."),
        ("assistant", TRIP_PLAN),
        ("user", "Great. Keep the same plan but add a lunch suggestion and an estimated cost to "
                 "every day, and repeat the full plan."))),
)

QUICK = tuple(next(p for p in PROMPTS if p.kind == kind) for kind in KINDS)
