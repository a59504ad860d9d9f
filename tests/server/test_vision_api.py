"""Images through the chat API: the openai SDK against a live server on a tiny Qwen3-VL.

A data: URL image gets an answer; every malformed image input gets a 4xx naming the
part; remote URLs are refused unless the host is in the allow-list.
"""
from __future__ import annotations

import base64
import http.server
import io
import sys
import threading
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).parent.parent))
from live_server import serving  # noqa: E402
from tiny_models_vl import build_qwen3_vl, test_picture as make_picture  # noqa: E402

from appliance.models.images import ImageError  # noqa: E402
from appliance.server.image_fetch import ImageFetchPolicy, image_bytes_from_url  # noqa: E402


def jpeg_bytes(width=100, height=72) -> bytes:
    buf = io.BytesIO()
    make_picture(width, height).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def data_url(data: bytes, mime="image/jpeg") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_message(url: str, text: str = "What is in this picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory):
    model_dir = build_qwen3_vl(tmp_path_factory.mktemp("vl_server_model"))
    with serving(model_dir, "--max-batch", "2", "--max-queue", "4", "--max-context", "1024",
                 "--request-timeout", "60", "--max-body-bytes", "262144", "--grace-period", "3",
                 env={"APPLIANCE_IMAGE_URL_HOSTS": "127.0.0.1"}) as srv:
        yield srv


@pytest.fixture
def vl_client(vl_server):
    from openai import OpenAI

    vl_server.wait_idle()
    return OpenAI(base_url=vl_server.base + "/v1", api_key="not-needed", max_retries=0, timeout=60)


def test_sdk_image_chat_gets_an_answer(vl_client, vl_server):
    model = vl_client.models.list().data[0].id
    reply = vl_client.chat.completions.create(model=model, messages=image_message(data_url(jpeg_bytes())),
                                              max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert isinstance(reply.choices[0].message.content, str)
    text_only = vl_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is in this picture?"}], max_tokens=1)
    # the 100x72 picture becomes 2x3 merged patches: 6 image tokens, between vision start/end tokens
    assert reply.usage.prompt_tokens >= text_only.usage.prompt_tokens + 6 + 2
    metrics = requests.get(vl_server.base + "/metrics", timeout=10).text
    assert "appliance_vision_encode_seconds_count" in metrics


def test_sdk_streams_with_an_image(vl_client):
    model = vl_client.models.list().data[0].id
    stream = vl_client.chat.completions.create(model=model, messages=image_message(data_url(jpeg_bytes(64, 64))),
                                               max_tokens=3, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("url, status, words", [
    ("https://example.com/cat.jpg", 400, "not allowed"),
    ("ftp://camera/cat.jpg", 400, "data: URL"),
    ("data:image/jpeg;base64,not base64!!", 400, "base64"),
    ("data:image/jpeg," + "abc", 400, "base64 data URL"),
    (data_url(b"this is not an image"), 400, "could not be decoded"),
    (data_url(b""), 400, "empty"),
])
def test_malformed_images_get_400(vl_server, url, status, words):
    vl_server.wait_idle()
    model = requests.get(vl_server.base + "/v1/models", timeout=10).json()["data"][0]["id"]
    r = requests.post(vl_server.base + "/v1/chat/completions", timeout=30,
                      json={"model": model, "messages": image_message(url), "max_tokens": 2})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["param"] == "messages[0].content[0].image_url"


def test_structurally_bad_image_parts_get_400(vl_server):
    model = requests.get(vl_server.base + "/v1/models", timeout=10).json()["data"][0]["id"]
    for part in ({"type": "image_url"}, {"type": "image_url", "image_url": {"url": 7}},
                 {"type": "input_audio", "input_audio": {}}):
        r = requests.post(vl_server.base + "/v1/chat/completions", timeout=30,
                          json={"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": [part]}]})
        assert r.status_code == 400, r.text


def test_oversized_image_gets_413(vl_server):
    model = requests.get(vl_server.base + "/v1/models", timeout=10).json()["data"][0]["id"]
    huge = data_url(b"\xff\xd8" + bytes(400_000))
    r = requests.post(vl_server.base + "/v1/chat/completions", timeout=30,
                      json={"model": model, "messages": image_message(huge), "max_tokens": 2})
    assert r.status_code == 413


def test_decompression_bomb_is_refused():
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (8000, 8000)).save(buf, format="PNG")     # 64 Mpixels in a few kB
    with pytest.raises(ImageError, match="over the limit"):
        from appliance.models.images import decode_image
        decode_image(buf.getvalue())


def test_remote_url_only_from_allowed_hosts():
    payload = jpeg_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_port}/snapshot.jpg"
    try:
        with pytest.raises(ImageError, match="not allowed"):
            image_bytes_from_url(url, ImageFetchPolicy())
        assert image_bytes_from_url(url, ImageFetchPolicy(allowed_hosts=["127.0.0.1"])) == payload
        with pytest.raises(ImageError, match="over the limit"):
            image_bytes_from_url(url, ImageFetchPolicy(allowed_hosts=["127.0.0.1"], max_bytes=100))
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def redirecting_host():
    """An image host on 127.0.0.1 that redirects /away to localhost (another host name) and
    /here to a path on itself; it counts the requests that reach the redirect targets."""
    payload = jpeg_bytes()
    served = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            port = self.server.server_port
            if self.path in ("/away", "/here"):
                host = "localhost" if self.path == "/away" else "127.0.0.1"
                self.send_response(302)
                self.send_header("Location", f"http://{host}:{port}/target.jpg")
                self.end_headers()
                return
            served.append(self.headers.get("Host"))
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}", served, payload
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_redirects_are_checked_against_the_allow_list(redirecting_host):
    base, served, payload = redirecting_host
    policy = ImageFetchPolicy(allowed_hosts=["127.0.0.1"])
    with pytest.raises(ImageError, match=r"redirects \(302\) to host 'localhost', which is not in the server's image URL allow-list"):
        image_bytes_from_url(base + "/away", policy)
    assert served == []                      # the refused target was never fetched
    assert image_bytes_from_url(base + "/here", policy) == payload   # a hop inside the list is fine


def test_allowed_host_redirecting_elsewhere_gets_400(vl_server, redirecting_host):
    base, served, _ = redirecting_host
    vl_server.wait_idle()
    model = requests.get(vl_server.base + "/v1/models", timeout=10).json()["data"][0]["id"]
    r = requests.post(vl_server.base + "/v1/chat/completions", timeout=30,
                      json={"model": model, "messages": image_message(base + "/away"), "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "redirect" in err["message"] and err["param"] == "messages[0].content[0].image_url"
    assert served == []
    r = requests.post(vl_server.base + "/v1/chat/completions", timeout=60,
                      json={"model": model, "messages": image_message(base + "/here"), "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_text_model_refuses_images(idle_server, model_id):
    r = requests.post(idle_server.base + "/v1/chat/completions", timeout=30,
                      json={"model": model_id, "messages": image_message(data_url(jpeg_bytes())), "max_tokens": 2})
    assert r.status_code == 400
    assert "does not take images" in r.json()["error"]["message"]
