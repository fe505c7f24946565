"""A minimal prefill/decode proxy for two vLLM servers that share a UMBP pool (issue #38;
docs/vllm.md "Disaggregated prefill").

    python -m umbp.vllm.pd_proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

For each OpenAI `/v1/completions` or `/v1/chat/completions` request it:

1. sends the request to the prefill engine (`kv_role: kv_producer`) with `max_tokens=1`,
   no streaming, and `kv_transfer_params: {"do_remote_decode": true}`; the engine computes
   the prompt's KV, stores it into the pool, and returns the handoff in the response's
   `kv_transfer_params`;
2. sends the original request to the decode engine (`kv_role: kv_consumer`) with those
   `kv_transfer_params`; its connector waits (without blocking its scheduler) until the
   handed-off blocks are in the pool, or the handoff's bound passes, then restores them;
3. returns the decode engine's response (streamed through when the client asked for it).

A prefill failure falls back to the decode engine alone (it then computes the prompt).
Standard library only; one thread per request. `--help` lists the flags.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("umbp.pd_proxy")

PATHS = ("/v1/completions", "/v1/chat/completions")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill engine gets: one token, no stream, a remote decode asked for
    (keeping any per-request options the client set, e.g. `umbp.max_store_tokens`)."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    params = dict(body.get("kv_transfer_params") or {})
    params["do_remote_decode"] = True
    out["kv_transfer_params"] = params
    return out


def decode_body(body: dict[str, Any], handoff: dict[str, Any] | None) -> dict[str, Any]:
    """The request the decode engine gets: the client's, with the prefill engine's
    `kv_transfer_params` (the handoff) merged over the client's own."""
    out = dict(body)
    if handoff:
        out["kv_transfer_params"] = {**dict(body.get("kv_transfer_params") or {}), **handoff}
    return out


def _post(url: str, body: dict[str, Any], timeout: float) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)  # noqa: S310 - operator-given URLs


def make_handler(prefill: str, decode: str, timeout: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            log.info("%s %s", self.address_string(), fmt % args)

        def _reply(self, code: int, payload: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path in ("/health", "/v1/models"):
                try:
                    with urllib.request.urlopen(decode + self.path, timeout=timeout) as r:  # noqa: S310
                        self._reply(r.status, r.read())
                except (urllib.error.URLError, OSError) as e:
                    self._reply(502, json.dumps({"error": f"decode engine: {e}"}).encode())
                return
            self._reply(404, b'{"error": "not found"}')

        def do_POST(self) -> None:  # noqa: N802
            if self.path not in PATHS:
                self._reply(404, json.dumps({"error": f"only {', '.join(PATHS)}"}).encode())
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("the body must be a JSON object")
            except (ValueError, json.JSONDecodeError) as e:
                self._reply(400, json.dumps({"error": f"bad request body: {e}"}).encode())
                return
            handoff = None
            try:
                with _post(prefill + self.path, prefill_body(body), timeout) as r:
                    handoff = json.loads(r.read()).get("kv_transfer_params")
            except (urllib.error.URLError, OSError, ValueError) as e:
                log.warning("prefill engine failed (%s); the decode engine computes the prompt", e)
            try:
                with _post(decode + self.path, decode_body(body, handoff), timeout) as r:
                    if body.get("stream"):
                        self.send_response(r.status)
                        self.send_header("Content-Type", r.headers.get("Content-Type", "text/event-stream"))
                        self.send_header("Transfer-Encoding", "chunked")
                        self.end_headers()
                        for chunk in iter(lambda: r.read1(65536), b""):
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.write(b"0\r\n\r\n")
                    else:
                        self._reply(r.status, r.read())
            except urllib.error.HTTPError as e:
                self._reply(e.code, e.read())
            except (urllib.error.URLError, OSError) as e:
                self._reply(502, json.dumps({"error": f"decode engine: {e}"}).encode())

    return Handler


def serve(prefill: str, decode: str, host: str = "127.0.0.1", port: int = 8000, timeout: float = 600.0) -> ThreadingHTTPServer:
    """The proxy's server, bound and not yet serving (call `serve_forever`)."""
    return ThreadingHTTPServer((host, port), make_handler(prefill.rstrip("/"), decode.rstrip("/"), timeout))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m umbp.vllm.pd_proxy",
        description="Prefill/decode proxy for two vLLM servers sharing a UMBP pool (docs/vllm.md).",
    )
    ap.add_argument("--prefill", required=True, help="base URL of the prefill engine (kv_role kv_producer)")
    ap.add_argument("--decode", required=True, help="base URL of the decode engine (kv_role kv_consumer)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream request (default 600)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    srv = serve(args.prefill, args.decode, args.host, args.port, args.timeout)
    log.info("listening on %s:%d: prefill %s, decode %s", args.host, args.port, args.prefill, args.decode)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
