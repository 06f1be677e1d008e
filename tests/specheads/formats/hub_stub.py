"""A stand-in for the Hugging Face Hub's HTTP API on 127.0.0.1: just what create_repo and upload_folder call,
checking each request and recording what it received. Anything else is answered 404, so an unexpected call fails."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = "hf_stub_token"


class HubStub:
    def __init__(self) -> None:
        self.repos: dict[str, dict] = {}  # repo id -> {"private": bool, "files": {path: bytes}}
        self.requests: list[tuple[str, str]] = []
        self.created: list[dict] = []  # repo creation payloads
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                stub.requests.append(("POST", self.path))
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._reply(401, {"error": "Invalid credentials"})
                if self.path == "/api/repos/create":
                    stub.created.append(json.loads(body))
                    return stub._create(self, json.loads(body))
                parts = self.path.split("/")  # /api/models/ORG/NAME/{preupload|commit}/main
                if len(parts) == 7 and parts[1:3] == ["api", "models"] and f"{parts[3]}/{parts[4]}" in stub.repos:
                    repo = f"{parts[3]}/{parts[4]}"
                    if parts[5] == "preupload":
                        files = json.loads(body)["files"]
                        return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                            "shouldIgnore": False} for f in files]})
                    if parts[5] == "commit":
                        return stub._commit(self, repo, body)
                return self._reply(404, {"error": f"stub: no route for POST {self.path}"})

            def do_GET(self) -> None:
                stub.requests.append(("GET", self.path))
                return self._reply(404, {"error": f"stub: no route for GET {self.path}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _create(self, handler, payload: dict) -> None:
        if payload.get("type", "model") != "model" or "/" in payload.get("name", "/"):
            return handler._reply(400, {"error": f"stub: malformed repo creation {payload}"})
        repo = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
        self.repos.setdefault(repo, {"private": bool(payload.get("private")), "files": {}})
        handler._reply(200, {"url": f"{self.url}/{repo}", "name": repo})

    def _commit(self, handler, repo: str, body: bytes) -> None:
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header" or not lines[0]["value"].get("summary"):
            return handler._reply(400, {"error": "stub: a commit starts with a header carrying a summary"})
        for line in lines[1:]:
            if line.get("key") != "file" or line["value"].get("encoding") != "base64":
                return handler._reply(400, {"error": f"stub: unexpected commit operation {line.get('key')}"})
            self.repos[repo]["files"][line["value"]["path"]] = base64.b64decode(line["value"]["content"])
        handler._reply(200, {"commitUrl": f"{self.url}/{repo}/commit/1", "commitOid": "1" * 40, "success": True})

    def __enter__(self) -> HubStub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
