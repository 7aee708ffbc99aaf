"""Headless Chromium (Debian's ``chromium``) driven over the DevTools protocol on a pipe.

``--remote-debugging-pipe`` reads NUL-terminated JSON commands on fd 3 and writes replies and events
on fd 4: no port, no websocket library, nothing listening on the host. Enough of the protocol to open
a page, read what the browser laid out, list every URL it fetched, and take a full-page screenshot.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser")


def chromium_path() -> str | None:
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


class DevToolsError(RuntimeError):
    pass


class Browser:
    def __init__(self, binary: str, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self._profile = tempfile.TemporaryDirectory(prefix="kvdrill-chromium-")
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()

        def wire() -> None:  # in the child: the protocol's fds are 3 (commands in) and 4 (replies out)
            a, b = os.dup(cmd_r), os.dup(out_w)  # first out of the way, in case either already is 3 or 4
            os.dup2(a, 3)
            os.dup2(b, 4)
            for fd in (3, 4):  # dup2 onto itself (a was already 3) keeps close-on-exec: clear it either way
                os.set_inheritable(fd, True)

        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
             "--disable-background-networking", "--disable-dev-shm-usage", "--hide-scrollbars",
             f"--user-data-dir={self._profile.name}", "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            # close_fds=False: the fds 3 and 4 wire() makes must survive to exec (pass_fds cannot name fds the
            # parent may not have open); every other fd Python opens is close-on-exec anyway (PEP 446)
            preexec_fn=wire, close_fds=False, start_new_session=True)
        os.close(cmd_r)
        os.close(out_w)
        self._buf = b""
        self._next = 0
        self.events: list[dict[str, Any]] = []

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise DevToolsError("no reply from chromium in time")
            chunk = os.read(self._out_r, 1 << 16)
            if not chunk:
                raise DevToolsError(f"chromium closed the pipe: {self.proc.stderr.read().decode()[-2000:] if self.proc.stderr else ''}")
            self._buf += chunk
        raw, _, self._buf = self._buf.partition(b"\0")
        return json.loads(raw)

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        self._next += 1
        msg: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise DevToolsError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, session: str | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        seen = next((e for e in self.events if e.get("method") == method and e.get("sessionId") == session), None)
        while seen is None:
            e = self._read_message(deadline)
            self.events.append(e)
            if e.get("method") == method and e.get("sessionId") == session:
                seen = e
        return seen

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except (DevToolsError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)  # its own session: only the processes this browser started
            self.proc.wait()
        os.close(self._cmd_w)
        os.close(self._out_r)
        self._profile.cleanup()


def render(page: Path, checks_js: str, screenshot: Path, width: int = 1200) -> tuple[Any, list[str]]:
    """Open ``page``, evaluate ``checks_js`` (its value comes back as JSON), save a full-page PNG to
    ``screenshot``; returns (that value, every URL the page made the browser fetch)."""
    binary = chromium_path()
    if binary is None:
        raise DevToolsError("no chromium on PATH (kvdrill setup installs Debian's chromium: pins.toml [system])")
    b = Browser(binary)
    try:
        target = b.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = b.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Network", "Runtime"):
            b.send(f"{domain}.enable", session=session)
        b.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": 900, "deviceScaleFactor": 1,
                                                      "mobile": False}, session=session)
        b.send("Page.navigate", {"url": page.resolve().as_uri()}, session=session)
        b.wait_event("Page.loadEventFired", session=session)
        value = b.send("Runtime.evaluate", {"expression": checks_js, "returnByValue": True, "awaitPromise": True},
                       session=session)["result"].get("value")
        size = b.send("Page.getLayoutMetrics", session=session)["cssContentSize"]
        b.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": int(size["height"]) + 1,
                                                      "deviceScaleFactor": 1, "mobile": False}, session=session)
        shot = b.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session=session)
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        screenshot.write_bytes(base64.b64decode(shot["data"]))
        urls = [e["params"]["request"]["url"] for e in b.events
                if e.get("method") == "Network.requestWillBeSent" and e.get("sessionId") == session]
        return value, urls
    finally:
        b.close()


# What a reader must see first and the pictures the issue asks for: each must be laid out with a size,
# not hidden, and an image must have decoded (naturalWidth > 0: the embedded PNG is a real picture).
KEY_ELEMENTS = ("headline", "checks", "timeline-plot", "hit-vs-correct-plot", "latency-plot", "leaks-plot",
                "failing", "record", "versions", "evidence")
VISIBILITY_JS = """(() => { const out = {};
for (const id of %s) {
  const el = document.getElementById(id);
  if (!el) { out[id] = null; continue; }
  const r = el.getBoundingClientRect(), s = getComputedStyle(el);
  out[id] = {width: r.width, height: r.height, top: r.top + window.scrollY,
             shown: s.visibility !== "hidden" && s.display !== "none" && s.opacity !== "0",
             decoded: el.tagName === "IMG" ? (el.complete && el.naturalWidth > 0) : null,
             text: (el.innerText || "").slice(0, 400)};
}
return out; })()"""


def check_report(page: Path, screenshot: Path) -> dict[str, Any]:
    """Render a report.html; assert every key element is visible and the page fetched nothing but
    itself and its embedded data: URLs; return what the browser saw per element."""
    seen, urls = render(page, VISIBILITY_JS % json.dumps(list(KEY_ELEMENTS)), screenshot)
    assert screenshot.stat().st_size > 10_000, "the screenshot is (nearly) empty"
    outside = [u for u in urls if not u.startswith(("data:", page.resolve().as_uri()))]
    assert not outside, f"report.html made the browser fetch {outside}: it must be self-contained"
    for name in KEY_ELEMENTS:
        el = seen.get(name)
        assert el is not None, f"#{name} is not in the page"
        assert el["shown"] and el["width"] > 100 and el["height"] > 20, f"#{name} is not visible: {el}"
        if el["decoded"] is not None:
            assert el["decoded"], f"#{name}: the browser could not decode the embedded image"
    assert seen["headline"]["top"] < seen["timeline-plot"]["top"] < seen["evidence"]["top"], "the verdict comes first"
    return seen
