"""Client–server (edge) speculative decoding: the drafter runs on the client, the target on the server.

protocol.py  binary frames (JSON header + raw tensors, fp32/bf16/fp16/int8)
service.py   server sessions: prefill, verify a client's tree, context for the client's drafter
routes.py    the session API on the gateway (/v1/edge/sessions...)
client.py    the client: drafts locally, one server call per cycle, keeps going offline
netem.py     two hosts on one machine (network namespaces + veth) with 5G/4G/cut link profiles
bench.py     `moa-serve edge-bench`
"""
