"""Serving the draft with the target, and measuring it.

- `sglang_args`: SGLang 0.5.23's launch flags and the effective speculative settings it derives;
  `sglang_dryrun`: SGLang's own resolution run on a host (a self-contained script).
- `decoding`: speculative decoding as SGLang runs it (chain and tree drafts), in-process.
- The reference server (`python -m eagle3.serve`): `settings` (launch), `scheduler` (the worker,
  metrics, decode log), `requests` and `http_api` (SGLang's endpoints and error shapes),
  `request_dumps` (SGLang's request dumps, on through `/configure_logging`), `serve`.
- `sglang_client`: the benchmark client for SGLang or the reference server.

The top wing: may import every wing below it.
"""
