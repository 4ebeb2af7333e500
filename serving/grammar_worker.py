"""A compile worker: a process that does one request's grammar work (xgrammar) at a time for a GrammarPool
(grammar_pool.py), so that no compile ever holds the gateway's event loop or the engine thread, and one that
runs too long, or whose client went away, can be stopped by ending its process.

    python -m serving.grammar_worker        (started by the pool; frames on stdin and stdout)

    pool -> worker   {"info": tokenizer info JSON | null, "limits": GrammarLimits}   once, at the start
    worker -> pool   {"ready": true}
    pool -> worker   {"grammar": [kind, source, param] | null, "tools": ToolCalling.payload() | null}
    worker -> pool   {"spec": [kind, source, param] | null, "compiled": serialized | null}
                     or {"refused": {"message", "param", "code"}}: the client's grammar, a 400
                     or {"error": traceback}: a fault of the worker, a 500

A frame is a 4-byte big-endian length, then that many bytes of JSON. Without tokenizer info (a gateway in
front of an upstream SGLang, which compiles for itself) the worker checks and converts, and compiles nothing.
The worker's file descriptor 1 is moved to stderr, so only frames reach the pool (xgrammar prints its
warnings on the C++ side).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any, BinaryIO

from sglang_ext.errors import InvalidRequest
from sglang_ext.grammar import GrammarLimits, Grammars, GrammarSpec, parse_grammar

from .api.tools import tool_grammar

HEADER = 4  # bytes of a frame's length


def encode_frame(message: dict) -> bytes:
    body = json.dumps(message).encode()
    return len(body).to_bytes(HEADER, "big") + body


def read_frame(stream: BinaryIO) -> Any:
    """The next message, or None at the end of the stream."""
    header = stream.read(HEADER)
    if len(header) < HEADER:
        return None
    return json.loads(stream.read(int.from_bytes(header, "big")))


def prepare(grammars: Grammars | None, limits: GrammarLimits, grammar: GrammarSpec | None, tools: dict | None):
    """(the spec the output must match, its compiled form): the client's grammar checked against the limits,
    or the call grammar built from its tools (every tool's schema checked, also under "auto", which has no
    grammar); compiled when there is a vocabulary (grammars)."""
    spec = tool_grammar(tools, limits) if tools is not None else None
    if grammar is not None:
        spec, parsed = grammar, parse_grammar(grammar, limits)
    else:
        parsed = parse_grammar(spec, None) if spec is not None else None
    compiled = grammars.compile_parsed(parsed) if grammars is not None and parsed is not None else None
    return spec, compiled


def handle(grammars: Grammars | None, limits: GrammarLimits, job: dict) -> dict:
    grammar = GrammarSpec(*job["grammar"]) if job.get("grammar") else None
    try:
        spec, compiled = prepare(grammars, limits, grammar, job.get("tools"))
    except InvalidRequest as e:
        return {"refused": {"message": str(e), "param": e.param, "code": e.code}}
    except Exception:  # noqa: BLE001 - the pool reports it as this request's server error; the worker carries on
        return {"error": traceback.format_exc()}
    return {
        "spec": None if spec is None else [spec.kind, spec.source, spec.param],
        "compiled": None if compiled is None else compiled.serialize_json(),
    }


def main() -> None:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything else written to stdout goes to stderr
    inp = sys.stdin.buffer
    init = read_frame(inp)
    if init is None:
        return
    limits = GrammarLimits(**init["limits"])
    grammars = Grammars.from_info_json(init["info"], limits) if init["info"] else None
    out.write(encode_frame({"ready": True}))
    out.flush()
    while (job := read_frame(inp)) is not None:
        out.write(encode_frame(handle(grammars, limits, job)))
        out.flush()


if __name__ == "__main__":
    main()
