"""Image intake (`multimodal.images`): every source a request may carry decodes as Pillow does,
and every hostile image (a decompression bomb, a truncated or mislabelled file, a 1x1 image,
10,000 images, a URL to this machine or a redirect to a private address, mutated headers) is
refused with one line, `invalid_request`, before anything large is allocated."""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from PIL import Image

from radixrt.config import MIN_IMAGE_SIDE, ImageSettings, ServerArgs
from radixrt.multimodal import images
from radixrt.multimodal.images import Base64Image, ImageError, load_image, load_images
from radixrt.protocol import ErrorCode

from helpers import mutated_header

DEFAULTS = ImageSettings()


@pytest.fixture(autouse=True)
def _pillows_bound_restored(monkeypatch):
    """`load_image` sets Pillow's process-wide bound to its settings' (tiny in some tests):
    each test leaves it as it found it, for the other tests of this process."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)


def noise(width: int, height: int, bands: int = 3, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, bands), dtype=np.uint8))


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def animated_gif() -> bytes:
    frames = [noise(36, 20, seed=s).convert("P", palette=Image.Palette.ADAPTIVE) for s in (1, 2)]
    return encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)


# name -> the file's bytes and its format (made once: hypothesis mutates them)
FILES = {
    "png": (encoded(noise(40, 30), "PNG"), "png"),
    "png_rgba": (encoded(noise(33, 21, bands=4), "PNG"), "png"),
    "jpeg_baseline": (encoded(noise(48, 32), "JPEG", quality=90), "jpeg"),
    "jpeg_progressive": (encoded(noise(48, 32), "JPEG", quality=90, progressive=True), "jpeg"),
    "webp_lossy": (encoded(noise(30, 26), "WEBP", quality=80), "webp"),
    "webp_lossless": (encoded(noise(30, 26), "WEBP", lossless=True), "webp"),
    "gif": (encoded(noise(25, 19).convert("P", palette=Image.Palette.ADAPTIVE), "GIF"), "gif"),
    "gif_animated": (animated_gif(), "gif"),
}


def reference(data: bytes) -> Image.Image:
    """The first frame as the families' processors see it: transformers' own RGB conversion
    (transparency onto white) of Pillow's own decode."""
    from transformers.image_transforms import convert_to_rgb

    return convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=False)


def refusal(source, settings: ImageSettings = DEFAULTS, index: int = 0) -> str:
    """The one-line message of `source`'s refusal, checked to be an `invalid_request`."""
    with pytest.raises(ImageError) as caught:
        load_image(source, settings, index)
    message = str(caught.value)
    assert caught.value.code is ErrorCode.INVALID_REQUEST and "\n" not in message, message
    assert message.startswith(f"image {index}: "), message
    return message


def png(width: int, height: int, idat: bytes, colour_type: int = 0) -> bytes:
    """A PNG built by hand: the signature, IHDR, one IDAT of `idat`, IEND (CRCs right)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )


# ---- what decodes ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(FILES))
def test_every_format_and_source_decodes_as_pillow_does(name):
    data, kind = FILES[name]
    want = reference(data)
    text = base64.b64encode(data).decode()
    media_type = f"image/{kind}"
    sources = [data, f"data:{media_type};base64,{text}", Base64Image(text, media_type), text]
    for source in sources:
        image = load_image(source, DEFAULTS)
        assert image.pixels.mode == "RGB" and image.pixels.tobytes() == want.tobytes(), name
        assert (image.width, image.height, image.format) == (*want.size, kind)
        assert image.key == hashlib.sha256(data).hexdigest()


def test_an_animated_gif_gives_its_first_frame():
    data = FILES["gif_animated"][0]
    opened = Image.open(io.BytesIO(data))
    opened.seek(1)
    second = opened.convert("RGB").tobytes()
    first = load_image(data, DEFAULTS).pixels.tobytes()
    assert first == reference(data).tobytes() and first != second


def test_the_key_is_the_bytes_not_the_pixels():
    """Two encodings of one picture are two images (the tree keys by bytes); one file sent as
    bytes, base64 or a data URL is one."""
    picture = noise(20, 20)
    a, b = encoded(picture, "PNG"), encoded(picture, "PNG", compress_level=1)
    assert a != b
    assert load_image(a, DEFAULTS).key != load_image(b, DEFAULTS).key
    url = "data:image/png;base64," + base64.b64encode(a).decode()
    assert load_image(url, DEFAULTS).key == load_image(a, DEFAULTS).key


def test_jpg_is_taken_for_jpeg_and_media_types_ignore_case():
    data = FILES["jpeg_baseline"][0]
    text = base64.b64encode(data).decode()
    assert load_image(Base64Image(text, "image/jpg"), DEFAULTS).format == "jpeg"
    assert load_image(f"data:IMAGE/JPEG;base64,{text}", DEFAULTS).format == "jpeg"


# ---- bounds: the bomb, sizes, bytes, counts --------------------------------------------------
# run in a fresh process (this one's peak RSS is torch's): the bomb's bytes come on stdin
BOMB_PROBE = """
import io, json, resource, sys, time
from PIL import Image
from radixrt.config import ImageSettings
from radixrt.multimodal.images import ImageError, load_image

settings, bomb = ImageSettings(), sys.stdin.buffer.read()
ordinary = io.BytesIO()
Image.new("RGB", (64, 64)).save(ordinary, "PNG")
load_image(ordinary.getvalue(), settings)  # Pillow's plugins, loaded once
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
try:
    load_image(bomb, settings)
    message = None
except ImageError as e:
    message = str(e)
seconds = time.perf_counter() - start
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"seconds": seconds, "rss_kib": grown, "message": message}))
"""


def test_a_decompression_bomb_is_refused_by_its_header_fast_and_small():
    """A 50,000 x 50,000 PNG (2.5 GB of pixels) whose IDAT is a few KB of zlib'd zeros: refused
    by name in < 100 ms with < 10 MB of peak RSS growth, after one ordinary image has loaded
    Pillow's plugins."""
    bomb = png(50_000, 50_000, zlib.compress(bytes(4 << 20), 9))
    assert len(bomb) < 16 << 10
    out = subprocess.run(
        [sys.executable, "-P", "-c", BOMB_PROBE], input=bomb, capture_output=True, timeout=120
    )
    assert out.returncode == 0, out.stderr.decode()
    probe = json.loads(out.stdout)
    print(f"bomb probe ({len(bomb)} bytes): {probe}")
    assert "50000 x 50000 pixels, past --max-image-pixels" in probe["message"]
    assert probe["seconds"] < 0.1 and probe["rss_kib"] < 10 << 10, probe


def test_a_jpeg_whose_frame_header_claims_huge_dimensions_is_refused_before_decoding():
    data = bytearray(FILES["jpeg_baseline"][0])
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", 65_535, 65_535)  # height, width
    start = time.perf_counter()
    message = refusal(bytes(data))
    assert "65535 x 65535 pixels, past --max-image-pixels" in message
    assert time.perf_counter() - start < 0.1


def test_a_gif_whose_first_image_grows_its_screen_past_the_bound_is_refused():
    """Pillow grows a GIF's size to hold its first image: so does the header check."""
    data = bytearray(FILES["gif_animated"][0])
    descriptor = 13 + (3 << ((data[10] & 7) + 1))  # past the global colour table
    while data[descriptor] == 0x21:  # past each extension: introducer, label, sub-blocks
        descriptor += 2
        while data[descriptor]:
            descriptor += 1 + data[descriptor]
        descriptor += 1
    assert data[descriptor] == 0x2C
    data[descriptor + 1 : descriptor + 5] = struct.pack("<HH", 60_000, 60_000)  # left, top
    assert "60036 x 60020 pixels" in refusal(bytes(data))


@pytest.mark.parametrize(("width", "height"), [(1, 1), (MIN_IMAGE_SIDE - 1, 100), (100, 3)])
def test_an_image_with_a_side_under_a_patch_is_refused(width, height):
    message = refusal(encoded(noise(width, height), "PNG"))
    assert f"each side must be at least {MIN_IMAGE_SIDE}" in message


def test_the_smallest_allowed_image_decodes():
    side = MIN_IMAGE_SIDE
    assert load_image(encoded(noise(side, side), "PNG"), DEFAULTS).pixels.size == (side, side)


def test_pixels_past_the_bound_are_refused_at_the_bound():
    data = encoded(noise(40, 30), "PNG")
    assert load_image(data, ImageSettings(max_image_pixels=1200)).width == 40
    assert "past --max-image-pixels (1199)" in refusal(data, ImageSettings(max_image_pixels=1199))


def test_bytes_past_the_bound_are_refused_and_base64_before_it_is_decoded(monkeypatch):
    data = FILES["png"][0]
    small = ImageSettings(max_image_bytes=len(data) - 1)
    assert "past --max-image-bytes" in refusal(data, small)
    monkeypatch.setattr(images.base64, "b64decode", lambda *a, **k: pytest.fail("decoded"))
    text = base64.b64encode(bytes(len(data) + 3)).decode()
    assert "characters of base64, past --max-image-bytes" in refusal(text, small)
    assert "past --max-image-bytes" in refusal(f"data:image/png;base64,{text}", small)


def test_ten_thousand_images_are_refused_by_count_before_any_is_decoded(monkeypatch):
    tiny = "data:image/png;base64," + base64.b64encode(FILES["png"][0]).decode()
    monkeypatch.setattr(images.base64, "b64decode", lambda *a, **k: pytest.fail("decoded"))
    monkeypatch.setattr(Image, "open", lambda *a, **k: pytest.fail("opened"))
    start = time.perf_counter()
    with pytest.raises(ImageError, match=r"^10000 images in one request, past --limit-mm"):
        load_images([tiny] * 10_000, DEFAULTS)
    assert time.perf_counter() - start < 0.05
    with pytest.raises(ImageError, match="past --limit-mm-per-prompt"):
        load_images([tiny], ImageSettings(limit_mm_per_prompt='{"image": 0}'))


def test_a_refusal_names_the_image_by_its_index_and_is_a_400():
    from radixrt.server.http.errors import from_runtime_error

    good = FILES["png"][0]
    with pytest.raises(ImageError, match=r"^image 1: ") as caught:
        load_images([good, b"GIF89a"], DEFAULTS)
    error = from_runtime_error(caught.value)
    assert (error.status, error.code) == (400, "invalid_request")


# ---- malformed and mislabelled ----------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(set(FILES) - {"gif_animated"}))  # its first frame whole
@pytest.mark.parametrize("keep", [0.95, 0.5, 0.1])
def test_a_truncated_file_is_refused(name, keep):
    data = FILES[name][0]
    refusal(data[: int(len(data) * keep)])


@pytest.mark.parametrize(
    ("declared", "name"),
    [("image/jpeg", "png"), ("image/png", "jpeg_baseline"), ("image/gif", "webp_lossy")],
)
def test_a_media_type_that_disagrees_with_the_bytes_is_refused(declared, name):
    text = base64.b64encode(FILES[name][0]).decode()
    kind = FILES[name][1].upper()
    want = f"declared {declared.split('/')[1].upper()}, but its bytes are {kind}"
    assert want in refusal(Base64Image(text, declared))
    assert want in refusal(f"data:{declared};base64,{text}")


@pytest.mark.parametrize(
    ("source", "says"),
    [
        (Base64Image("AAAA", "image/svg+xml"), "media type 'image/svg+xml' is not one of"),
        ("data:image/bmp;base64,Qk0=", "media type 'image/bmp' is not one of"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        ("data:image/png;base64,iVBORw0KGgo", "not valid base64"),  # padding missing
        ("data:image/png,%89PNG", "must start 'data:image/<type>;base64,'"),
        ("data:image/png;base64", "must start 'data:image/<type>;base64,'"),
        ("data:" + "x" * 300 + ";base64,AAAA", "must start 'data:image/<type>;base64,'"),
        ("not base64!", "not valid base64"),
        ("", "not a PNG, JPEG, WebP or GIF image"),
        (b"BM" + bytes(100), "not a PNG, JPEG, WebP or GIF image"),
        (encoded(noise(20, 20), "TIFF"), "not a PNG, JPEG, WebP or GIF image"),
    ],
)
def test_malformed_sources_are_refused(source, says):
    assert says in refusal(source)


def test_a_jpeg_with_junk_or_two_frame_headers_is_refused():
    data = FILES["jpeg_baseline"][0]
    sof = data.index(b"\xff\xc0")
    assert "where a marker belongs" in refusal(data[:sof] + b"\x00" + data[sof:])
    length = data[sof + 2] << 8 | data[sof + 3]
    frame = data[sof : sof + 2 + length]
    assert "2 frame headers" in refusal(data[:sof] + frame + data[sof:])


def test_a_jpeg_with_too_many_scans_is_refused():
    data = FILES["jpeg_progressive"][0]
    eoi = data.rindex(b"\xff\xd9")
    scans = b"\xff\xda\x00\x02" * images.MAX_JPEG_SCANS  # SOS bytes, counted before decoding
    assert f"more than {images.MAX_JPEG_SCANS}" in refusal(data[:eoi] + scans + data[eoi:])


def test_a_png_of_tiny_chunks_is_refused_after_a_bounded_walk():
    """A PNG's chunks are walked (Pillow reads each in Python): past MAX_HEADER_STEPS, refused."""
    data = FILES["png"][0]
    iend = data.rindex(b"IEND") - 4
    filler = struct.pack(">I", 0) + b"tEXt" + struct.pack(">I", zlib.crc32(b"tEXt"))
    start = time.perf_counter()
    message = refusal(data[:iend] + filler * images.MAX_HEADER_STEPS + data[iend:])
    assert f"more than {images.MAX_HEADER_STEPS} chunks" in message
    assert time.perf_counter() - start < 1


# ---- nothing local is read, remote only from allowed public hosts ----------------------------
def test_local_files_are_never_read(tmp_path):
    path = tmp_path / "cat.png"
    path.write_bytes(FILES["png"][0])
    for source in (str(path), f"file://{path}", "file:///etc/passwd", "/etc/passwd"):
        message = refusal(source)
        assert "never read" in message or "not valid base64" in message, message
    assert "a file: URL is never read" in refusal(f"FILE://{path}")
    assert "a ftp: URL is never read" in refusal("ftp://example.com/cat.png")


def test_remote_urls_are_refused_unless_a_flag_names_their_host():
    message = refusal("http://127.0.0.1/cat.png")
    assert "remote image URLs are refused: --allowed-media-domains names" in message
    allowed = ImageSettings(allowed_media_domains=("images.example.com",))
    assert "'127.0.0.1' is not in --allowed-media-domains" in refusal(
        "https://127.0.0.1/cat.png", allowed
    )


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.1.2.3",
        "192.168.0.1",
        "169.254.169.254",  # cloud metadata
        "100.64.0.1",  # shared (CGNAT)
        "0.0.0.0",
        "224.0.0.1",
        "240.0.0.1",
        "::1",
        "fe80::1%1",
        "fc00::1",
        "::ffff:127.0.0.1",
    ],
)
def test_an_allowed_host_with_a_private_address_is_refused_before_connecting(address, monkeypatch):
    """Any one private address among a host's is enough (it may be the one answering)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    answers = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.215.14", 80))]
    answers.append((family, socket.SOCK_STREAM, 6, "", (address, 80)))
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: answers)
    allowed = ImageSettings(allowed_media_domains=("images.example.com",))
    message = refusal("http://images.example.com/cat.png", allowed)
    assert f"resolves to {address}, not a public address" in message


def test_an_allowed_address_literal_is_checked_as_a_resolved_one():
    allowed = ImageSettings(allowed_media_domains=("127.0.0.1", "localhost"))
    for url in ("http://127.0.0.1:9/cat.png", "http://localhost:9/cat.png"):
        assert "not a public address" in refusal(url, allowed)


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"])
def test_public_addresses_are_public(address):
    assert images.is_public_address(address)


class _Images(http.server.BaseHTTPRequestHandler):
    """The test server: an image, redirects (to a private address, a loop, a file: URL), a body
    past the byte bound without a length, one that declares it, and a slow answer."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        port = self.server.server_address[1]
        routes = {
            "/cat.png": (200, {"Content-Type": "image/png"}, FILES["png"][0]),
            "/to-private": (302, {"Location": f"http://private.test:{port}/cat.png"}, b""),
            "/to-cat": (301, {"Location": "/cat.png"}, b""),
            "/loop": (302, {"Location": "/loop"}, b""),
            "/to-file": (302, {"Location": "file:///etc/passwd"}, b""),
            "/big": (200, {}, bytes(64 << 10)),
            "/declared-big": (200, {"Content-Length": str(10**9)}, b""),
        }
        if self.path == "/slow":
            time.sleep(1.5)
        status, headers, body = routes.get(self.path, (404, {}, b""))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def image_server(monkeypatch):
    """A server on 127.0.0.1, reached as public.test (taken as public: 127.0.0.1 stands in for
    a public address here) and private.test (127.0.0.2, private)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    resolve = socket.getaddrinfo
    names = {"public.test": "127.0.0.1", "private.test": "127.0.0.2"}

    def getaddrinfo(host, port, *args, **kwargs):
        return resolve(names.get(host, host), port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(images, "is_public_address", lambda address: address == "127.0.0.1")
    yield f"http://public.test:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


ALLOWED = ImageSettings(
    allowed_media_domains=("public.test", "private.test"), max_image_bytes=32 << 10
)


def test_an_allowed_public_host_is_fetched_and_redirects_are_followed(image_server):
    for path in ("/cat.png", "/to-cat"):
        image = load_image(f"{image_server}{path}", ALLOWED)
        assert image.key == hashlib.sha256(FILES["png"][0]).hexdigest()


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("/to-private", "'private.test' resolves to 127.0.0.2, not a public address"),
        ("/loop", "more than 3 redirects"),
        ("/to-file", "a redirect to a file: URL is never followed"),
        ("/big", "more than --max-image-bytes (32768) while streaming"),
        ("/declared-big", "1000000000 bytes, past --max-image-bytes"),
        ("/missing", "answered HTTP 404"),
    ],
)
def test_a_fetch_is_refused_at_each_bound(image_server, path, says):
    assert says in refusal(f"{image_server}{path}", ALLOWED)


def test_a_slow_host_is_refused_at_the_timeout(image_server, monkeypatch):
    monkeypatch.setattr(images, "MEDIA_FETCH_TIMEOUT_S", 0.3)
    start = time.perf_counter()
    assert "no image from public.test within 0.3 s" in refusal(f"{image_server}/slow", ALLOWED)
    assert time.perf_counter() - start < 1


# ---- settings ---------------------------------------------------------------------------------
def test_limit_mm_per_prompt_takes_vllms_json():
    assert ServerArgs(limit_mm_per_prompt='{"image": 4}').max_images == 4
    assert ServerArgs(limit_mm_per_prompt='{"image": 0, "video": 1}').max_images == 0
    assert ServerArgs(limit_mm_per_prompt='{"video": 1}').max_images == DEFAULTS.max_images == 32
    for bad in ("4", "image=4", '{"image": -1}', '{"image": true}', '{"image": {"count": 2}}'):
        with pytest.raises(ValueError, match="limit_mm_per_prompt takes JSON like"):
            ServerArgs(limit_mm_per_prompt=bad)


def test_allowed_media_domains_takes_host_names():
    assert ServerArgs(allowed_media_domains=("images.example.com",)).allowed_media_domains
    for bad in ("https://images.example.com", "images.example.com:443", "*.example.com", ""):
        with pytest.raises(ValueError, match="allowed_media_domains takes host names"):
            ServerArgs(allowed_media_domains=(bad,))


# ---- mutated headers: decoded or refused, in bounded time --------------------------------------
SMALL = ImageSettings(max_image_pixels=1 << 16)


@pytest.mark.parametrize("name", sorted(FILES))
@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_mutated_headers_are_decoded_or_refused_in_bounded_time(name, data):
    """Bytes of the headers (the first 512) overwritten, inserted or cut: the image decodes,
    within the bounds, or is refused with one line; never another exception, never slow."""
    original = FILES[name][0]
    mutated = mutated_header(data, original, min(len(original), 512))
    start = time.perf_counter()
    try:
        image = load_image(mutated, SMALL)
        assert image.pixels.mode == "RGB"
        assert min(image.pixels.size) >= MIN_IMAGE_SIDE
        assert image.width * image.height <= SMALL.max_image_pixels
        event("decoded")
    except ImageError as e:
        assert "\n" not in str(e) and str(e).startswith("image 0: ")
        event("refused")
    assert time.perf_counter() - start < 1
