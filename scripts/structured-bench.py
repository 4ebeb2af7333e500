"""Structured output under speculation, bs 1, greedy, one run: each prompt asks for JSON under a JSON
schema; methods run interleaved prompt by prompt (so the machine's drift hits them alike):

  vanilla            no grammar, no drafter (the speed reference)
  vanilla+schema     the grammar's mask on every step, no drafter (what the mask costs)
  suffix+schema      the shipped suffix drafter (tree 3,1,4) with the mask walked along each tree path
  suffix             the suffix drafter without a grammar

With `--workload tools` each prompt asks a question two functions could answer, the functions written
into the prompt by the gateway's tool rendering, and "schema" is a required call (the gateway's EBNF
for tool_choice "required", one call); without it the model answers as under tool_choice "auto".

Prints tokens/s per method, its ratio to vanilla, and tau; writes results/<out>/results.json.

    .venv/bin/python scripts/structured-bench.py --out results/structured
    .venv/bin/python scripts/structured-bench.py --workload tools --out results/tools
"""

from __future__ import annotations

import argparse
import json
import time

from bench_table import new_totals, record, report

from serving.api.tools import call_grammar, parse_tools, render_messages, split_output
from serving.config import EngineConfig
from serving.engine import Engine
from sglang_ext.drafters import make_drafter
from sglang_ext.grammar import GrammarSpec
from sglang_ext.models import load_target
from sglang_ext.sampling import SamplingParams
from sglang_ext.tree import TreeShape

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "summary": {"type": "string"},
        "facts": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "summary", "facts"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_web",
            "description": "Search the web",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "max_results": {"type": "integer"}},
                "required": ["query"],
            },
        },
    },
]
TOPICS = [
    "Paris",
    "the Moon",
    "honey bees",
    "the Nile",
    "chess",
    "volcanoes",
    "Mozart",
    "the Internet",
    "penguins",
    "coffee",
    "the Roman Empire",
    "glass",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--workload", choices=("json", "tools"), default="json")
    ap.add_argument("--out", default="results/structured")
    args = ap.parse_args()
    target = load_target("smollm2", dtype="float32")
    tools = parse_tools(TOOLS, "required", False)
    if args.workload == "json":
        spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
        prompts = [
            [{"role": "user", "content": f"Describe {t} as JSON with a name, a summary and a list of facts."}]
            for t in TOPICS
        ]
    else:
        spec = GrammarSpec("ebnf", call_grammar(list(tools.functions), parallel=False))
        prompts = [
            render_messages(
                [{"role": "user", "content": f"What is the weather like where {t} is, and what is new about {t}?"}],
                tools,
            )
            for t in TOPICS
        ]
    suffix = make_drafter("suffix", target)
    methods = {
        "vanilla": (Engine(target, None), None),
        "vanilla+schema": (Engine(target, None), spec),
        "suffix+schema": (Engine(target, suffix, EngineConfig(tree=TreeShape(3, 1, 4))), spec),
        "suffix": (Engine(target, make_drafter("suffix", target), EngineConfig(tree=TreeShape(3, 1, 4))), None),
    }
    totals = new_totals(methods, "finished", "valid")
    for messages in prompts[: args.num_prompts]:
        ids = target.encode_chat(messages)
        for name, (eng, grammar) in methods.items():
            t0 = time.perf_counter()
            r = eng.generate([ids], SamplingParams(max_new_tokens=args.max_new_tokens, grammar=grammar))[0]
            record(totals[name], r, time.perf_counter() - t0)
            if r.finish_reason == "stop":
                totals[name]["finished"] += 1
                totals[name]["valid"] += _valid(target.decode(r.output_ids), args.workload, tools)
    report(totals, ("finished", "valid"), args, args.out)


def _valid(text: str, workload: str, tools) -> bool:
    """JSON: the text parses; tools: it holds at least one well-formed call."""
    if workload == "tools":
        return bool(split_output(text, tools)[1])
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
