"""No tenant can crowd out another, on the embedded engine: SmolLM2 (fp32) + the n-gram drafter behind a real uvicorn
server on 127.0.0.1, a plain API-keys file (one key per line: two tenants of equal weight, key1 and key2),
`--max-running 4 --max-queue 4`, the real HTTP clients.

Order is read from the admission queue's own log (serving/tenancy.py: each event under the queue's lock), never
from timing: while the test holds a gate shut the drafter waits at it once the engine runs its 4 requests, so those
stay in flight (and the queue behind them full) until the test opens it, however fast or slow the machine is.
"""

import threading

import httpx
import pytest
from helpers import AdmissionLog, flood, slots_whole, wait_for

from serving.backends.base import Admission
from serving.config import EngineConfig
from serving.engine import Engine
from serving.gateway.app import GatewayConfig, create_app
from serving.gateway.auth import APIKeys, key_id, tenant_key
from serving.gateway.server import ServerThread, embedded_backend
from sglang_ext.drafters import NgramDrafter, default_tree

MODEL = "smollm2"
CHAT = "/v1/chat/completions"
KEYS = ("sk-tenant-a-3f9c2e71d0", "sk-tenant-b-81d07a4c55")
A, B = "key1", "key2"  # their tenants (the keys' places in the file)


class GatedNgram(NgramDrafter):
    """The n-gram drafter, whose propose for a batch of `hold` requests waits while the test holds its gate shut: they
    stay in flight until then. A smaller batch drafts on (a first request that started decoding before the others
    arrived, on a loaded machine, would otherwise hold the engine with fewer running than the queue admits)."""

    def __init__(self, hold: int):
        super().__init__()
        self.hold = hold
        self.gate = threading.Event()
        self.gate.set()

    def propose(self, batch, shape):
        if len(batch) >= self.hold:
            assert self.gate.wait(timeout=120), "the test never opened the gate"
        return super().propose(batch, shape)


@pytest.fixture(scope="module")
def served(smollm2_fp32, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text("\n".join(KEYS) + "\n")
    drafter = GatedNgram(hold=4)  # (Admission's max running)
    engine = Engine(smollm2_fp32, drafter, EngineConfig(tree=default_tree("ngram"), kv_slots=4096))
    backend, telemetry = embedded_backend(engine, MODEL, "ngram", admission=Admission(4, 4))
    app = create_app(backend, telemetry, GatewayConfig(api_keys=APIKeys(file=keys)))
    with ServerThread(app) as srv:
        srv.backend, srv.drafter, srv.engine = backend, drafter, engine
        yield srv


def chat(content: str, max_tokens: int) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def post(srv, key: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + CHAT, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300)


def text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_a_flooding_tenant_cannot_crowd_out_a_steady_one(served):
    """A keeps 12 requests in flight, B sends one at a time: B never gets a 429, each of B's requests is admitted
    before every A request that was queued when it arrived, A's excess gets 429 + Retry-After, and every answer
    equals the same request alone (greedy). Alone, A is queued and refused as one queue always was."""
    body_a, body_b = chat("Count from 1 to 30, separated by commas.", 5), chat("Name a color.", 3)
    alone_a, alone_b = text(post(served, KEYS[0], body_a)), text(post(served, KEYS[1], body_b))
    b_responses: list[httpx.Response] = []
    with AdmissionLog() as log:
        served.drafter.gate.clear()
        fa = flood(served.url, CHAT, body_a, KEYS[0], clients=12)
        try:
            # one tenant, as one queue always was: 4 running, 4 queued, the rest refused
            wait_for("A's 4 running and 4 queued", lambda: served.backend.load() == (4, 4))
            wait_for("A's excess refused", lambda: fa.statuses().count(429) >= 4)
            first_b = threading.Thread(target=lambda: b_responses.append(post(served, KEYS[1], body_b)))
            first_b.start()
            wait_for(
                "B's first request queued (or answered)",
                lambda: ("queued", B) in [e[:2] for e in log.events] or b_responses,
            )
            served.drafter.gate.set()
            first_b.join(300)
            for _ in range(2):  # then one at a time, while A keeps 12 in flight
                wait_for("A's queue refilled", lambda: served.backend.load()[1] >= 3)
                b_responses.append(post(served, KEYS[1], body_b))
        finally:
            served.drafter.gate.set()
            fa.stop.set()
            for t in fa.threads:
                t.join(300)

    assert [r.status_code for r in b_responses] == [200] * 3, [r.text for r in b_responses]
    assert all(text(r) == alone_b for r in b_responses)
    ok_a = [body for status, _, body in fa.results if status == 200]
    refused_a = [(retry, body) for status, retry, body in fa.results if status == 429]
    assert ok_a and all(b["choices"][0]["message"]["content"] == alone_a for b in ok_a)
    assert {s for s, _, _ in fa.results} <= {200, 429}
    assert len(refused_a) >= 4
    for retry, body in refused_a:
        assert int(retry) >= 1 and set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == "rate_limit_exceeded"

    # A alone (before B's first arrival): admitted in the order it arrived
    first_b_seq = next(seq for event, who, seq in log.events if (event, who) == ("queued", B))
    upto = log.events.index(("queued", B, first_b_seq))
    admitted_alone = [seq for event, who, seq in log.events[:upto] if event == "admitted"]
    assert admitted_alone == sorted(admitted_alone) and len(admitted_alone) >= 4

    arrivals = log.queued_at_arrivals(B)
    assert len(arrivals) == 3 and arrivals[0][1], "B's first request found A's queue full"
    for seq, a_waiting in arrivals:
        assert seq in [s for e, _, s in log.events if e == "admitted"], f"B's #{seq} was never admitted"
        assert not a_waiting & set(log.admitted_before(seq)), f"an A request queued before B's #{seq} went first"
    assert not [e for e in log.events if e[1] == B and e[0] in ("refused", "pushed out")]
    assert ("pushed out", A) in [e[:2] for e in log.events]  # B took its place in the full queue from A

    wait_for("the engine idle", lambda: served.backend.load() == (0, 0))
    assert slots_whole(served.engine)
    no_key_material(log.lines, "the serving log")


def test_per_tenant_metrics_carry_tenant_names_and_no_key_material(served):
    """After the flood above (and again here: one request of each), /metrics has the moa_tenant_* series of key1
    and key2 and nothing derived from a key."""
    for key in KEYS:
        assert post(served, key, chat("Say hi.", 2)).status_code == 200
    metrics = httpx.get(served.url + "/metrics").text
    no_key_material([metrics], "/metrics")
    series = {}
    for line in metrics.splitlines():
        if line.startswith("moa_tenant_"):
            name, value = line.rsplit(" ", 1)
            series[name] = float(value)

    def value(family: str, tenant: str, **labels) -> float:
        want = {f'tenant="{tenant}"', *(f'{k}="{v}"' for k, v in labels.items())}
        hits = [
            v
            for k, v in series.items()
            if k.startswith(family + "{") and want <= set(k[len(family) + 1 : -1].split(","))
        ]
        assert len(hits) == 1, (family, tenant, labels, hits)
        return hits[0]

    for tenant in (A, B):
        assert value("moa_tenant_requests_total", tenant, status="ok") >= 2
        assert value("moa_tenant_prompt_tokens_total", tenant) > 0
        assert value("moa_tenant_generated_tokens_total", tenant) >= 8
        assert value("moa_tenant_queue_time_seconds_count", tenant) >= 2
    assert value("moa_tenant_requests_total", A, status="rejected") >= 4
    assert value("moa_tenant_rejections_total", A, reason="queue") >= 4
    assert not [k for k in series if 'tenant="' in k and f'tenant="{A}"' not in k and f'tenant="{B}"' not in k]


def no_key_material(texts: list[str], where: str) -> None:
    """Neither key, nor a digest the gateway derives from one (its id, the prefix cache namespace), in `texts`."""
    secrets = [*KEYS, *(key_id(f"Bearer {k}") for k in KEYS), *(tenant_key(key_id(f"Bearer {k}"), None) for k in KEYS)]
    for t in texts:
        for s in secrets:
            assert s not in t and s[:12] not in t, f"key material in {where}"


def test_two_authorization_headers_or_a_second_place_for_the_key_is_a_400(served):
    """A request carries exactly one API key: a wrong key followed by a right one is not accepted (the last
    header used to win), nor a right key beside another in x-api-key, api-key or the query string."""
    good, bad = f"Bearer {KEYS[0]}", "Bearer sk-wrong"
    body = chat("Say hi.", 2)
    cases = [
        [("authorization", bad), ("authorization", good)],
        [("authorization", good), ("authorization", good)],
        [("authorization", good), ("x-api-key", KEYS[1])],
        [("authorization", good), ("api-key", KEYS[0])],
    ]
    with httpx.Client(base_url=served.url, timeout=60) as c:
        for headers in cases:
            r = c.post(CHAT, json=body, headers=headers)
            assert r.status_code == 400 and r.json()["error"]["code"] == "ambiguous_api_key", (headers, r.text)
            assert KEYS[0] not in r.text and KEYS[1] not in r.text
        for query in ("api_key", "key", "access_token"):
            r = c.post(CHAT + f"?{query}={KEYS[1]}", json=body, headers={"authorization": good})
            assert r.status_code == 400 and query in r.json()["error"]["message"]
        assert c.post(CHAT, json=body, headers={"authorization": good}).status_code == 200
        r = c.post(CHAT, json=body, headers={"x-api-key": KEYS[0]})  # a key only elsewhere: no key (401), as before
        assert r.status_code == 401
        assert c.get("/health", headers=cases[0]).status_code == 200  # the exempt paths read no key


def test_every_known_tenant_has_its_series_at_zero_before_its_first_request(tmp_path):
    """/metrics declares each keys-file tenant's series at 0 (a series born with its first burst already counted
    shows Prometheus no increase: the per-tenant panels would stay empty)."""
    from prometheus_client import generate_latest

    from serving.backends.telemetry import Telemetry
    from serving.metrics import Metrics

    (tmp_path / "keys").write_text(
        "sk-plain-7c1d0e\nsk-named-99ab01 tenant=team-a weight=2\nsk-named-99ab02 tenant=team-a\n"
    )
    keys = APIKeys(file=tmp_path / "keys")
    assert keys.tenant_names() == ["key1", "team-a"]
    telemetry = Telemetry(Metrics(), "ngram", "embedded")
    telemetry.tenants.declare(keys.tenant_names())
    text = generate_latest(telemetry.metrics.registry).decode()
    for tenant in ("key1", "team-a"):
        for family in ("moa_tenant_queue_time_seconds_count", "moa_tenant_prompt_tokens_total"):
            (line,) = [x for x in text.splitlines() if x.startswith(family + "{") and f'tenant="{tenant}"' in x]
            assert line.endswith(" 0.0"), line
        assert (
            f'moa_tenant_requests_total{{backend="embedded",drafter="ngram",status="ok",tenant="{tenant}"}} 0.0' in text
        )
