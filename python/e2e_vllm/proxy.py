"""A disaggregated-prefill proxy for vLLM's OpenAI server, the shape of vLLM's own example
(``toy_proxy_server.py``): nothing in it is kvferry's.

    python proxy.py --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

``POST /v1/completions``: the request goes to the prefill instance with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}``; the ``kv_transfer_params`` of its answer go
with the original request to the decode instance, whose answer is the client's.
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web


def app(prefill: str, decode: str) -> web.Application:
    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        session: aiohttp.ClientSession = request.app["session"]
        first = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        }
        first.pop("max_completion_tokens", None)
        async with session.post(f"{prefill}/v1/completions", json=first) as r:
            if r.status != 200:
                return web.Response(status=r.status, text=await r.text())
            answer = await r.json()
        second = {**body, "kv_transfer_params": answer.get("kv_transfer_params")}
        async with session.post(f"{decode}/v1/completions", json=second) as r:
            return web.Response(
                status=r.status, body=await r.read(), content_type="application/json"
            )

    async def start(application: web.Application) -> None:
        # A connection per request: a pooled one that the server's keep-alive timeout (5 s in
        # uvicorn) closes just as a request reuses it is reset under it, which a slow prefill
        # on a loaded host made happen (a 500 from this proxy, not from vLLM).
        application["session"] = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None),
            connector=aiohttp.TCPConnector(force_close=True),
        )

    async def stop(application: web.Application) -> None:
        await application["session"].close()

    application = web.Application()
    application.router.add_post("/v1/completions", completions)
    application.on_startup.append(start)
    application.on_cleanup.append(stop)
    return application


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True)
    parser.add_argument("--decode", required=True)
    args = parser.parse_args()
    web.run_app(app(args.prefill, args.decode), host="127.0.0.1", port=args.port, print=None)
