"""Edge (client–server) decoding on a real uvicorn server (127.0.0.1) with a tiny random Llama:
connected identity, disconnect + resync through a link that can be cut, bad input, TTL, frames."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch
from helpers import compare_to_reference, tiny_config, tiny_state

from moa_serve.benchmarks.netem import PROFILES, LinkProxy
from serving.edge.client import EdgeClient, collect
from serving.edge.protocol import pack, unpack
from serving.edge.service import EdgeLimits, EdgeService
from serving.engine import Engine
from serving.gateway.app import create_app
from serving.gateway.server import ServerThread, embedded_backend
from sglang_ext.drafters.eagle3 import Eagle3Drafter
from sglang_ext.drafters.moa import MoADrafter
from sglang_ext.models import LlamaModel, Target
from sglang_ext.models.eagle3 import Eagle3Config, Eagle3Draft
from sglang_ext.models.moa import MoAConfig, MoADraft
from sglang_ext.sampling import SamplingParams
from sglang_ext.tree import TreeShape

VOCAB, LAYERS = 64, 6


def _target(seed=0) -> Target:
    cfg = tiny_config(vocab=VOCAB, layers=LAYERS)
    return Target(model=LlamaModel(cfg, tiny_state(cfg, seed)), tokenizer=None, path=None)


def _moa(target, tli, seed=1) -> MoADraft:
    torch.manual_seed(seed)
    d = MoADraft(MoAConfig.for_target(target.cfg, tli=tli))
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return d


def _eagle(target, seed=1) -> Eagle3Draft:
    torch.manual_seed(seed)
    d = Eagle3Draft(Eagle3Config.for_target(target.cfg, VOCAB))
    d.set_vocab(torch.arange(VOCAB))
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return d


@pytest.fixture(scope="module")
def setup():
    target = _target()
    drafts = {"moa-tli0": _moa(target, 0), "moa-tli1": _moa(target, 1), "eagle3": _eagle(target)}
    server_drafters = {
        "moa-tli0": MoADrafter(target.model, drafts["moa-tli0"]),
        "moa-tli1": MoADrafter(target.model, drafts["moa-tli1"]),
        "eagle3": Eagle3Drafter(target.model, drafts["eagle3"]),
    }
    service = EdgeService(
        target, server_drafters, EdgeLimits(ttl_s=60, max_tree_nodes=32, max_session_tokens=512, kv_slots=8192)
    )
    backend, telemetry = embedded_backend(Engine(target, None), "tiny", "none")
    with ServerThread(create_app(backend, telemetry, edge=service)) as srv:
        yield target, drafts, service, srv


def _client(target, drafts, name, url, **kw) -> EdgeClient:
    d = drafts[name]
    local = Eagle3Drafter(target.model, d) if name == "eagle3" else MoADrafter(target.model, d, remote=True)
    return EdgeClient(url, local, name, TreeShape(4, 3, 10), **kw)


def _prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(3, 16, (n,), generator=g)]


def _reference(target, prompts, n):
    return [
        r.output_ids for r in Engine(target, None).generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))
    ]


@pytest.mark.parametrize("name", ["moa-tli0", "moa-tli1", "eagle3"])
@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_connected_output_equals_server_only_generation(setup, name, dtype):
    target, drafts, service, srv = setup
    prompts = _prompts(3, 7)
    ref = _reference(target, prompts, 40)
    client = _client(target, drafts, name, srv.url, dtype=dtype)
    free = service.kv.num_free
    for p, r in zip(prompts, ref):
        verified, pending = collect(client.generate(p, max_new_tokens=40))
        assert not pending and len(verified) == 40
        assert compare_to_reference(target.model, p, r, verified) != "bug"
    st = client.stats
    assert st.cycles > 0 and st.calls == st.cycles + len(prompts) and st.disconnects == 0
    assert st.accepted > 0, "the drafter never got a token accepted: its context is wrong"
    assert service.kv.num_free == free and not service.sessions  # sessions closed, KV returned
    assert client.drafter.reqs == {}


@pytest.mark.parametrize("resync", ["verify", "keep"])
@pytest.mark.parametrize("name", ["moa-tli0", "moa-tli1"])
def test_disconnect_keeps_generating_then_resyncs(setup, name, resync):
    target, drafts, service, srv = setup
    prompt = _prompts(1, 3)[0]
    ref = _reference(target, [prompt], 80)[0]
    with LinkProxy("127.0.0.1", srv.port, PROFILES["lan"]) as link:
        client = _client(target, drafts, name, link.url, timeout_s=1.0, resync=resync, backoff_s=(0.05, 0.2))
        events, produced, offline_seen = [], 0, 0
        gen = client.generate(prompt, max_new_tokens=80)
        for ev in gen:
            events.append(ev)
            produced += len(ev.tokens)
            if ev.kind == "draft":
                offline_seen += 1
                if offline_seen == 12:
                    link.restore()  # back online after 12 offline tokens
            if produced >= 30 and not link.is_cut and offline_seen == 0:
                link.cut()
    verified, pending = collect(iter(events))
    st = client.stats
    assert st.disconnects == 1 and st.offline_tokens >= 12, st
    assert any(e.kind == "confirm" for e in events)
    assert not pending and len(verified) == 80
    if resync == "verify":
        # offline tokens were verified and replaced from the first disagreement: nothing lost, nothing doubled
        assert compare_to_reference(target.model, prompt, ref, verified) != "bug"
    else:
        # kept as drafted: the output is the reference up to the cut, then the offline tokens, then greedy from there
        cut_at = next(i for i, e in enumerate(events) if e.kind == "draft")
        before = sum(len(e.tokens) for e in events[:cut_at] if e.kind == "token")
        assert verified[:before] == ref[:before]
        offline = [t for e in events if e.kind == "draft" for t in e.tokens]
        assert verified[before : before + st.offline_kept] == offline[: st.offline_kept]
    assert not service.sessions


class _CharTokenizer:
    """Just enough of a tokenizer for `moa-serve edge` on the tiny target: a prompt's characters as ids."""

    eos_token_id = None

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, continue_final_message=False):
        return messages[-1]["content"]

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_cli_edge_json_against_the_server(setup, monkeypatch, capsys):
    """`moa-serve edge --json`: one JSON object like generate's, the greedy output, the drafter's default tree."""
    from moa_serve.entrypoints.cli import main

    target, drafts, service, srv = setup
    local = Target(model=target.model, tokenizer=_CharTokenizer(), path=None)
    monkeypatch.setattr("sglang_ext.models.load_target", lambda *a, **k: local)
    monkeypatch.setattr(
        "serving.edge.client.local_drafter", lambda t, name: MoADrafter(t.model, drafts[name], remote=True)
    )
    prompt = "edge prompt"
    argv = ["edge", "--server", srv.url, "--prompt", prompt, "--max-new-tokens", "24", "--device", "cpu", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = local.encode_chat([{"role": "user", "content": prompt}])
    ref = _reference(target, [ids], 24)[0]
    assert len(out["token_ids"]) == 24 and compare_to_reference(target.model, ids, ref, out["token_ids"]) != "bug"
    assert out["text"] == local.decode(out["token_ids"]) and out["finish_reason"] == "length"
    assert out["drafter"] == "moa-tli1" and out["tree"] == [1, 2, 3] and out["tree_min_prob"] == 0.1
    assert out["verify_steps"] > 0 and 0 < out["draft_tokens_per_step"] <= 2 and out["accept_length"] >= 1
    assert out["tokens_per_s"] > 0 and out["unverified_tokens"] == 0 and out["disconnects"] == 0
    assert not service.sessions


def _post(srv, path, body, **kw):
    return httpx.post(srv.url + path, json=body, timeout=10, **kw)


def test_bad_input_gets_clear_errors(setup):
    target, drafts, service, srv = setup
    r = _post(srv, "/v1/edge/sessions", {"prompt_token_ids": [1, 2, 3], "drafter": "moa-tli0", "dtype": "fp16"})
    assert r.status_code == 200
    head, ctx = unpack(r.content)
    sid, root = head["session_id"], head["root"]
    assert set(ctx) == {"ca_k", "ca_v"} and ctx["ca_k"].shape[0] == 3
    cases = [
        ("/v1/edge/sessions/nope/verify", {"seq_len": 3, "tokens": [root], "parents": [-1]}, 404, "session_not_found"),
        (
            f"/v1/edge/sessions/{sid}/verify",
            {"seq_len": 3, "tokens": [root, 5], "parents": [-1, 1]},
            400,
            "invalid_value",
        ),  # malformed tree
        (
            f"/v1/edge/sessions/{sid}/verify",
            {"seq_len": 3, "tokens": [root] * 40, "parents": list(range(-1, 39))},
            400,
            "invalid_value",
        ),  # too large
        (
            f"/v1/edge/sessions/{sid}/verify",
            {"seq_len": 3, "tokens": [root, 999], "parents": [-1, 0]},
            400,
            "invalid_value",
        ),  # out of vocab
        (
            f"/v1/edge/sessions/{sid}/verify",
            {"seq_len": 3, "tokens": [(root + 1) % VOCAB], "parents": [-1]},
            409,
            "session_out_of_sync",
        ),
        (
            f"/v1/edge/sessions/{sid}/verify",
            {"seq_len": 7, "tokens": [root], "parents": [-1]},
            409,
            "session_out_of_sync",
        ),
        (f"/v1/edge/sessions/{sid}/verify", {"seq_len": 3, "tokens": "x", "parents": [-1]}, 400, "invalid_value"),
        (
            f"/v1/edge/sessions/{sid}/verify",
            {"seq_len": 3, "tokens": [root], "parents": [-1], "mode": "yolo"},
            400,
            "invalid_value",
        ),
        ("/v1/edge/sessions", {"prompt_token_ids": [1], "drafter": "medusa"}, 400, "invalid_value"),
        ("/v1/edge/sessions", {"prompt_token_ids": [], "drafter": "moa-tli0"}, 400, "invalid_value"),
        ("/v1/edge/sessions", {"prompt_token_ids": [1], "drafter": "moa-tli0", "dtype": "fp8"}, 400, "invalid_value"),
        ("/v1/edge/sessions", {"prompt_token_ids": [1] * 600, "drafter": "moa-tli0"}, 400, "context_length_exceeded"),
    ]
    for path, body, status, code in cases:
        r = _post(srv, path, body)
        assert r.status_code == status, (path, body, r.text)
        err = r.json()["error"]
        assert err["code"] == code and err["message"], (body, err)
    r = httpx.post(srv.url + f"/v1/edge/sessions/{sid}/verify", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    # the session still works after all that
    r = _post(srv, f"/v1/edge/sessions/{sid}/verify", {"seq_len": 3, "tokens": [root], "parents": [-1]})
    assert r.status_code == 200 and unpack(r.content)[0]["seq_len"] == 4
    assert httpx.delete(srv.url + f"/v1/edge/sessions/{sid}").status_code == 200
    assert httpx.delete(srv.url + f"/v1/edge/sessions/{sid}").status_code == 404


def test_lost_response_is_redone_exactly_once(setup):
    """A client whose verify response was lost resends from its seq_len: the server rolls back once."""
    target, drafts, service, srv = setup
    head, _ = unpack(_post(srv, "/v1/edge/sessions", {"prompt_token_ids": [4, 5, 6], "drafter": "moa-tli1"}).content)
    sid, root = head["session_id"], head["root"]
    body = {"seq_len": 3, "tokens": [root, 1, 2], "parents": [-1, 0, 0]}
    first = unpack(_post(srv, f"/v1/edge/sessions/{sid}/verify", body).content)[0]
    again = unpack(_post(srv, f"/v1/edge/sessions/{sid}/verify", body).content)[0]  # response "lost", resent
    assert first == again
    assert service.sessions[sid].seq_len == first["seq_len"]
    service.close(sid)


def test_killed_client_frees_server_memory_after_ttl():
    target = _target(seed=2)
    service = EdgeService(
        target, {"moa-tli0": MoADrafter(target.model, _moa(target, 0))}, EdgeLimits(ttl_s=0.2, kv_slots=1024)
    )
    free = service.kv.num_free
    head, _ = service.create([1, 2, 3, 4], "moa-tli0")
    assert service.kv.num_free < free
    (sess,) = service.sessions.values()  # the client vanished: no more calls
    assert service.reap(now=sess.last_used + 0.15) == 0 and service.sessions  # (within the TTL)
    assert service.reap(now=sess.last_used + 0.25) == 1 and service.kv.num_free == free and not service.sessions


def test_frames_round_trip_and_int8_error_is_small():
    x = torch.randn(5, 3, 8) * 4
    for dtype, tol in (("fp32", 0.0), ("fp16", 1e-2), ("bf16", 5e-2), ("int8", 0.02)):
        head, t = unpack(pack({"a": 1}, {"x": x, "e": torch.zeros(0, 4)}, dtype))
        assert head == {"a": 1} and t["x"].shape == x.shape and t["e"].shape == (0, 4)
        err = ((t["x"] - x).abs() / x.abs().amax(-1, keepdim=True)).max()
        assert err <= tol, (dtype, err)
    assert len(pack({}, {"x": x}, "int8")) < len(pack({}, {"x": x}, "fp16")) < len(pack({}, {"x": x}, "fp32"))


def test_namespace_host_link_cut_and_restore():
    """Two hosts on one machine: a server inside a network namespace, reached over the veth pair
    through the 4G-profile relay; link down -> requests fail; link up -> they work again."""
    import subprocess
    import sys

    from moa_serve.benchmarks.netem import NamespaceHost, namespaces_available

    reason = namespaces_available()
    if reason:
        pytest.skip(reason)
    with NamespaceHost(7, rate_mbit=20) as host:
        srv = host.popen(
            [sys.executable, "-m", "http.server", "8000", "--bind", host.ns_ip],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            with LinkProxy(host.ns_ip, 8000, PROFILES["4g"]) as link:
                deadline = time.monotonic() + 20
                while True:
                    try:
                        t0 = time.monotonic()
                        assert httpx.get(link.url + "/", timeout=2).status_code == 200
                        rtt = time.monotonic() - t0
                        break
                    except httpx.TransportError:
                        assert time.monotonic() < deadline, "server in the namespace never answered"
                        time.sleep(0.2)
                assert rtt >= 0.004  # two one-way delays of 2..40 ms each
                host.cut()
                with pytest.raises(httpx.TransportError):
                    httpx.get(link.url + "/", timeout=1)
                host.restore()
                assert httpx.get(link.url + "/", timeout=5).status_code == 200
        finally:
            srv.terminate()
            srv.wait(10)


def test_link_delay_runs_from_each_chunks_arrival():
    """A message written in two parts (HTTP headers, then body) arrives one delay after it was sent,
    as over a real link, not after a delay per part (the relay once waited out a chunk's delay before
    reading the next, so a request/response cycle could pay two round trips). Echo over a 200 ms
    one-way link: two writes 20 ms apart come back ~420 ms after the first, not ~620 ms."""
    import socket
    import threading

    from moa_serve.benchmarks.netem import Profile

    echo = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = echo.accept()
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    # 500 ms each way: one-way + echo = 1.0 s when each chunk's delay runs from its arrival, 1.5 s when the
    # body also waits out the head's delay; the bound sits between them, far from scheduling noise
    with LinkProxy("127.0.0.1", echo.getsockname()[1], Profile("fixed", 500.0, 0.0, 0.0, None)) as link:
        with socket.create_connection(("127.0.0.1", link.port)) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0 = time.monotonic()
            c.sendall(b"head")
            time.sleep(0.02)
            c.sendall(b"body")
            got = b""
            while len(got) < 8:
                got += c.recv(8)
            elapsed = time.monotonic() - t0
    echo.close()
    assert got == b"headbody"
    assert 1.0 <= elapsed < 1.35, elapsed


def test_link_delivers_every_byte_and_shuts_down_quietly(caplog):
    """What the far side wrote before closing all arrives (the relay half-closes after the last byte,
    it does not abort with bytes still buffered), and closing the link with a connection still open
    logs no error (a cancelled relay task used to surface as 'Exception in callback')."""
    import logging
    import socket
    import threading

    payload = bytes(range(256)) * 8192  # 2 MiB
    upstream = socket.create_server(("127.0.0.1", 0))
    relayed = threading.Event()

    def serve():
        for i in range(2):
            conn, _ = upstream.accept()
            if i == 0:
                with conn:
                    conn.sendall(payload)
            else:
                relayed.set()
                threading.Event().wait(5)  # keeps the second connection open
                conn.close()

    threading.Thread(target=serve, daemon=True).start()
    caplog.set_level(logging.ERROR, logger="asyncio")
    with LinkProxy("127.0.0.1", upstream.getsockname()[1], PROFILES["lan"]) as link:
        with socket.create_connection(("127.0.0.1", link.port)) as c:
            got = bytearray()
            while chunk := c.recv(1 << 16):
                got += chunk
        idle = socket.create_connection(("127.0.0.1", link.port))
        assert relayed.wait(timeout=30)  # the relay is connected upstream and waiting
    idle.close()
    upstream.close()
    assert bytes(got) == payload
    assert not [r for r in caplog.records if r.name == "asyncio"], [r.getMessage() for r in caplog.records]
