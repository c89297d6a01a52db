"""An image as a request carries it, made a decoded RGB picture with a content key, with every
bound checked from the bytes and the header before anything is decoded.

Sources (`ImageSource`):
- `str`: a `data:image/<type>;base64,...` URL (OpenAI's `image_url.url`, Responses'
  `input_image.image_url`); an `http://` or `https://` URL, fetched only from a host that
  `--allowed-media-domains` names (`fetch`); or bare base64 (SGLang's `image_data`), whose first
  bytes say its format. Any other scheme (`file://`) is refused, and a path is not base64: nothing
  on this machine is ever read for a request.
- `Base64Image`: base64 with the media type the request declares beside it (Anthropic's
  `source: {type: base64, media_type, data}`).
- `bytes`: an image file's bytes, as the DSL and `rt.Engine` take them.

The checks, in order, each refusal an `ImageError` (`invalid_request`, HTTP 400) that names the
image's index and what was wrong:
1. the count (`--limit-mm-per-prompt`), before any image is looked at (`check_image_count`);
2. the bytes (`--max-image-bytes`): base64 by its length before it is decoded, a remote body
   while it streams;
3. the format, from its magic bytes: PNG, JPEG, WebP or GIF (its first frame); a declared media
   type must agree;
4. width and height, read by this module's own parsers (PNG's IHDR, JPEG's SOFn, WebP's VP8,
   VP8L or VP8X, GIF's logical screen grown by its first image, as Pillow grows it), every
   offset and length checked against the buffer: each side at least MIN_IMAGE_SIDE, their
   product at most `--max-image-pixels`. A decompression bomb is refused here, by its header;
5. the work Pillow does in Python before its C decoders run: PNG's chunks, JPEG's segments up to
   its first scan and GIF's blocks up to its first image are walked in at most MAX_HEADER_STEPS
   steps, and junk where a marker or block belongs (which Pillow skips a byte at a time) is
   refused; a JPEG has one frame header and at most MAX_JPEG_SCANS scans (each one a pass over
   every pixel);
6. Pillow opens the bytes as that format only, its size must be the header's, and it decodes:
   whatever it raises (truncated, corrupt) is a refusal. Its own `Image.MAX_IMAGE_PIXELS` is the
   same bound, so no path through it allocates past it either.

The picture is RGB, transparency composited onto white (`processors.to_rgb`, transformers'
`convert_to_rgb`); EXIF orientation is not applied (transformers' processors do not either). Its
key is the SHA-256 of the image's bytes: what the radix tree keys an image by, known without a
decode.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import io
import ipaddress
import re
import socket
import ssl
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import SplitResult, urljoin, urlsplit

from PIL import Image

from radixrt.config import (
    MAX_MEDIA_REDIRECTS,
    MEDIA_FETCH_TIMEOUT_S,
    MIN_IMAGE_SIDE,
    ImageSettings,
)
from radixrt.multimodal.processors import to_rgb
from radixrt.protocol import ErrorCode, RequestError

# Chunks, segments or blocks walked per image: libpng writes 8 KiB IDAT chunks (2,560 in 20 MiB),
# a JPEG has tens of segments before its first scan; each step is O(1) here and in Pillow.
MAX_HEADER_STEPS = 1 << 14
# A progressive JPEG has about 10 scans (libjpeg's default script); each costs a pass over every
# pixel, so thousands of them in a small file would hold a thread for minutes.
MAX_JPEG_SCANS = 100
MAX_DATA_URL_HEADER = 256  # 'data:image/png;base64,' with room for parameters
FETCH_CHUNK_BYTES = 64 << 10
PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP", "gif": "GIF"}
MEDIA_TYPES = {
    "image/png": "png",
    "image/jpeg": "jpeg",
    "image/jpg": "jpeg",  # not registered, but what many clients send
    "image/webp": "webp",
    "image/gif": "gif",
}
REDIRECTS = frozenset({301, 302, 303, 307, 308})
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,31}:")  # base64 holds no colon; bounded work
_JPEG_FRAMES = frozenset(
    {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
)
_JPEG_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM, RST0-7: no length follows
_JPEG_SOS = 0xDA


class ImageError(RequestError):
    """An image refused: `invalid_request` (HTTP 400), one line naming what was wrong."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.INVALID_REQUEST, message)


@dataclass(frozen=True)
class Base64Image:
    """Base64 and the media type declared beside it (Anthropic's `source` of type base64)."""

    data: str
    media_type: str


ImageSource = str | bytes | Base64Image


@dataclass(frozen=True, eq=False)
class DecodedImage:
    """An image decoded: `pixels` (RGB), `key` (SHA-256 of its bytes, hex), `format` (png,
    jpeg, webp or gif)."""

    pixels: Image.Image
    key: str
    format: str

    @property
    def width(self) -> int:
        return self.pixels.width

    @property
    def height(self) -> int:
        return self.pixels.height


def check_image_count(count: int, settings: ImageSettings) -> None:
    """Refuse a request carrying more images than `--limit-mm-per-prompt` allows: on the
    gateway's event loop, before any image is looked at."""
    if count > settings.max_images:
        raise ImageError(
            f"{count} images in one request, past --limit-mm-per-prompt ({settings.max_images})"
        )


def load_images(sources: Sequence[ImageSource], settings: ImageSettings) -> list[DecodedImage]:
    """A request's images, in order: the count checked first, then each as `load_image`."""
    check_image_count(len(sources), settings)
    return [load_image(source, settings, index) for index, source in enumerate(sources)]


def load_image(source: ImageSource, settings: ImageSettings, index: int = 0) -> DecodedImage:
    """`source` checked and decoded, or an `ImageError` naming image `index` (its place in the
    request, from 0). It blocks (a decode takes up to about a second at --max-image-pixels, a
    remote fetch up to MEDIA_FETCH_TIMEOUT_S): the gateway runs it on its CPU pool
    (`CpuPool.run`, radixrt/server/http/cpu_pool.py: bounded threads, heavy jobs shared fairly
    between tenants), one job per image after `check_image_count` on the event loop, never on
    the loop or the runtime's serving loop; `rt.Engine` and the DSL run it in the caller's
    thread. Pillow's decoders release the GIL while they run."""
    try:
        data, declared = _encoded(source, settings)
        if len(data) > settings.max_image_bytes:
            raise ImageError(
                f"{len(data)} bytes, past --max-image-bytes ({settings.max_image_bytes})"
            )
        kind = _sniff(data)
        if declared is not None and declared != kind:
            raise ImageError(f"declared {declared.upper()}, but its bytes are {kind.upper()}")
        width, height = _SIZES[kind](data)
        if min(width, height) < MIN_IMAGE_SIDE:
            raise ImageError(
                f"{width} x {height} pixels: each side must be at least {MIN_IMAGE_SIDE}"
            )
        if width * height > settings.max_image_pixels:
            raise ImageError(
                f"{width} x {height} pixels, past --max-image-pixels "
                f"({settings.max_image_pixels}); nothing was decoded"
            )
        walk = _WALKS.get(kind)  # WebP is walked by libwebp in C, GIF by _gif_size
        if walk is not None:
            walk(data)
        pixels = _decode(data, kind, (width, height), settings.max_image_pixels)
    except ImageError as e:
        raise ImageError(f"image {index}: {e}") from None
    return DecodedImage(pixels, hashlib.sha256(data).hexdigest(), kind)


# ---- sources to bytes ---------------------------------------------------------------------------
def _encoded(source: ImageSource, settings: ImageSettings) -> tuple[bytes, str | None]:
    """The image's bytes, and the format its source declares (None: the bytes alone say)."""
    if isinstance(source, bytes):
        return source, None
    if isinstance(source, Base64Image):
        declared = _declared(source.media_type)
        return _base64(source.data, settings.max_image_bytes), declared
    scheme = _SCHEME.match(source)
    if scheme is None:
        return _base64(source, settings.max_image_bytes), None
    name = scheme.group()[:-1].lower()
    if name == "data":
        return _data_url(source, settings.max_image_bytes)
    if name in ("http", "https"):
        return fetch(source, settings), None
    raise ImageError(
        f"a {name}: URL is never read: an image is a data: URL, base64, or an http(s):// URL"
    )


def _declared(media_type: str) -> str:
    kind = MEDIA_TYPES.get(media_type.strip().lower())
    if kind is None:
        allowed = ", ".join(sorted(set(MEDIA_TYPES) - {"image/jpg"}))
        raise ImageError(f"media type {media_type[:64]!r} is not one of {allowed}")
    return kind


def _data_url(url: str, max_bytes: int) -> tuple[bytes, str]:
    comma = url.find(",", 0, MAX_DATA_URL_HEADER)
    media_type, _, encoding = url[len("data:") : max(comma, 0)].rpartition(";")
    if comma < 0 or encoding.strip().lower() != "base64":
        raise ImageError("a data: URL must start 'data:image/<type>;base64,'")
    declared = _declared(media_type.partition(";")[0])
    return _base64(url[comma + 1 :], max_bytes), declared


def _base64(text: str, max_bytes: int) -> bytes:
    """`text` decoded, refused before decoding when it holds more than `max_bytes`."""
    if len(text) > 4 * -(-max_bytes // 3):  # the longest base64 of max_bytes bytes
        raise ImageError(
            f"{len(text)} characters of base64, past --max-image-bytes ({max_bytes}) decoded"
        )
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:  # binascii.Error, or a character outside ASCII
        raise ImageError("not valid base64 (and a path is never read)") from None


# ---- remote images --------------------------------------------------------------------------
def fetch(url: str, settings: ImageSettings) -> bytes:
    """The body at `url`, an http:// or https:// URL, fetched only when `--allowed-media-domains`
    names its host and every address the host resolves to is public (`is_public_address`); the
    socket then connects to that checked address, so a name that resolves elsewhere a moment
    later (DNS rebinding) changes nothing. Redirects are followed by hand, at most
    MAX_MEDIA_REDIRECTS, each one's URL checked again the same way. The whole fetch takes at
    most MEDIA_FETCH_TIMEOUT_S (name resolution aside: the resolver's own timeout bounds it),
    and a body past `--max-image-bytes` is refused by its Content-Length or while it streams.
    No proxy, no cookies, no credentials."""
    deadline = time.monotonic() + MEDIA_FETCH_TIMEOUT_S
    for _ in range(MAX_MEDIA_REDIRECTS + 1):
        parts = urlsplit(url)
        host, port = _allowed_host(parts, settings)
        tls = ssl.create_default_context() if parts.scheme == "https" else None
        address, remaining = _public_address(host, port), deadline - time.monotonic()
        if remaining <= 0:
            raise ImageError(f"no image from {host} within {MEDIA_FETCH_TIMEOUT_S:g} s")
        connection = _PinnedConnection(host, port, address, remaining, tls)
        try:
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            connection.request("GET", target, headers={"Accept": "image/*"})
            response = connection.getresponse()
            if response.status in REDIRECTS:
                location = response.getheader("Location")
                if not location:
                    raise ImageError(f"{host} redirected without a Location")
                url = urljoin(url, location)
                continue
            if response.status != 200:
                raise ImageError(f"{host} answered HTTP {response.status}")
            return _body(response, connection.stream, settings.max_image_bytes, deadline)
        except TimeoutError:
            raise ImageError(f"no image from {host} within {MEDIA_FETCH_TIMEOUT_S:g} s") from None
        except (OSError, http.client.HTTPException) as e:
            raise ImageError(f"fetching from {host} failed: {_one_line(e)}") from None
        finally:
            connection.close()
    raise ImageError(f"more than {MAX_MEDIA_REDIRECTS} redirects")


def _allowed_host(parts: SplitResult, settings: ImageSettings) -> tuple[str, int]:
    """The URL's host and port, when its scheme is http(s) and the host is on the list."""
    if not settings.allowed_media_domains:
        raise ImageError(
            "remote image URLs are refused: --allowed-media-domains names the hosts they may come from"
        )
    if parts.scheme not in ("http", "https"):
        raise ImageError(f"a redirect to a {parts.scheme[:16]}: URL is never followed")
    host = parts.hostname or ""
    if host not in {h.lower() for h in settings.allowed_media_domains}:
        raise ImageError(f"host {host[:256]!r} is not in --allowed-media-domains")
    if parts.username is not None or parts.password is not None:
        raise ImageError("an image URL with credentials is refused")
    try:
        return host, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ImageError(f"the URL's port is not a port: {parts.netloc[:256]!r}") from None


def is_public_address(address: str) -> bool:
    """Whether an address is globally reachable: not private, loopback, link-local, shared
    (CGNAT), reserved, unspecified or multicast, an IPv4-mapped IPv6 address as its IPv4."""
    ip = ipaddress.ip_address(address.partition("%")[0])  # an IPv6 zone aside
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def _public_address(host: str, port: int) -> str:
    """One address of `host`'s, when all of them are public (a name with any private address
    may be answered by it)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise ImageError(f"host {host!r} does not resolve") from None
    addresses = [str(info[4][0]) for info in infos]
    for address in addresses:
        if not is_public_address(address):
            raise ImageError(f"host {host!r} resolves to {address}, not a public address")
    return addresses[0]


class _PinnedConnection(http.client.HTTPConnection):
    """HTTP, or HTTPS when given `tls`, to `host` at `address`: the socket connects to the
    checked address, and TLS checks the certificate against the host's name."""

    def __init__(
        self, host: str, port: int, address: str, timeout: float, tls: ssl.SSLContext | None
    ):
        super().__init__(host, port, timeout=timeout)
        self.address, self.tls = address, tls
        if tls is not None:
            self.default_port = 443  # the Host header names no port when it is the scheme's

    def connect(self) -> None:
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = (
            sock if self.tls is None else self.tls.wrap_socket(sock, server_hostname=self.host)
        )
        # the response reads from it after http.client has dropped `sock` (a body that ends
        # when the connection closes): its timeout is still set before each read
        self.stream = self.sock


def _body(
    response: http.client.HTTPResponse,
    stream: socket.socket,
    max_bytes: int,
    deadline: float,
) -> bytes:
    """The response's body, refused past `max_bytes` (by Content-Length, or while it streams)
    or past `deadline` (each read waits at most until then)."""
    length = response.getheader("Content-Length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise ImageError(f"{length} bytes, past --max-image-bytes ({max_bytes})")
    chunks: list[bytes] = []
    size = 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        stream.settimeout(remaining)
        chunk = response.read1(FETCH_CHUNK_BYTES)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > max_bytes:
            raise ImageError(f"more than --max-image-bytes ({max_bytes}) while streaming")
        chunks.append(chunk)


# ---- formats and sizes, from the bytes --------------------------------------------------------
def _sniff(data: bytes) -> str:
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "gif"
    if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        return "webp"
    raise ImageError("not a PNG, JPEG, WebP or GIF image (by its first bytes)")


def _truncated(kind: str) -> ImageError:
    return ImageError(f"{kind} header is truncated")


def _png_size(data: bytes) -> tuple[int, int]:
    """IHDR's width and height: the first chunk, 13 bytes long."""
    if len(data) < 8 + 8 + 13:
        raise _truncated("PNG")
    length, kind, width, height = struct.unpack_from(">I4sII", data, 8)
    if kind != b"IHDR" or length != 13:
        raise ImageError("PNG's first chunk is not a 13-byte IHDR")
    return width, height


def _png_walk(data: bytes) -> None:
    """Every chunk up to IEND lies within the data, there are at most MAX_HEADER_STEPS of them,
    and one is image data."""
    at, image_data = 8, False
    for _ in range(MAX_HEADER_STEPS):
        if at + 12 > len(data):
            raise ImageError("PNG is truncated: no IEND chunk")
        length, kind = struct.unpack_from(">I4s", data, at)
        if at + 12 + length > len(data):
            raise ImageError(f"PNG is truncated: its {kind!r} chunk runs past the end")
        if kind == b"IEND":
            if not image_data:
                raise ImageError("PNG has no image data (IDAT)")
            return
        image_data |= kind == b"IDAT"
        at += 12 + length
    raise ImageError(f"PNG has more than {MAX_HEADER_STEPS} chunks")


def _jpeg_segments(data: bytes) -> Iterator[tuple[int, int, int]]:
    """(marker, payload offset, payload length) of each segment after SOI up to the first scan's
    (SOS) included, fill bytes skipped; at most MAX_HEADER_STEPS steps."""
    at = 2
    for _ in range(MAX_HEADER_STEPS):
        if at + 2 > len(data):
            raise ImageError("JPEG is truncated before its first scan")
        if data[at] != 0xFF:
            raise ImageError(f"JPEG has byte 0x{data[at]:02x} at {at}, where a marker belongs")
        marker = data[at + 1]
        if marker == 0xFF:  # a fill byte
            at += 1
            continue
        if marker in _JPEG_STANDALONE:
            at += 2
            continue
        if marker in (0x00, 0xD8, 0xD9):
            raise ImageError(f"JPEG has marker 0xff{marker:02x} before its first scan")
        if at + 4 > len(data):
            raise ImageError("JPEG is truncated before its first scan")
        length = (data[at + 2] << 8) | data[at + 3]
        if length < 2 or at + 2 + length > len(data):
            raise ImageError(f"JPEG's segment 0xff{marker:02x} at {at} runs past the end")
        yield marker, at + 4, length - 2
        if marker == _JPEG_SOS:
            return
        at += 2 + length
    raise ImageError(f"JPEG has no scan within {MAX_HEADER_STEPS} markers")


def _jpeg_size(data: bytes) -> tuple[int, int]:
    """The first frame header's (SOFn) width and height."""
    for marker, at, length in _jpeg_segments(data):
        if marker in _JPEG_FRAMES:
            if length < 6:
                raise ImageError("JPEG's frame header is too short")
            height, width = struct.unpack_from(">HH", data, at + 1)
            return width, height
    raise ImageError("JPEG has no frame header before its first scan")


def _jpeg_walk(data: bytes) -> None:
    """One frame header before the first scan (Pillow would take the last), and at most
    MAX_JPEG_SCANS scans (an SOS marker's bytes cannot occur in entropy-coded data)."""
    frames = sum(marker in _JPEG_FRAMES for marker, _, _ in _jpeg_segments(data))
    if frames != 1:
        raise ImageError(f"JPEG has {frames} frame headers")
    scans = data.count(b"\xff\xda")
    if scans > MAX_JPEG_SCANS:
        raise ImageError(f"JPEG has {scans} scans, more than {MAX_JPEG_SCANS}")


def _webp_size(data: bytes) -> tuple[int, int]:
    """The first chunk's size: VP8's key frame header (14 bits a side), VP8L's header (14 bits,
    less one), or VP8X's canvas (24 bits, less one)."""
    if len(data) < 30:
        raise _truncated("WebP")
    chunk, length = struct.unpack_from("<4sI", data, 12)
    if 20 + length > len(data):
        raise ImageError(f"WebP is truncated: its {chunk!r} chunk runs past the end")
    if chunk == b"VP8 " and length >= 10:
        if data[23:26] != b"\x9d\x01\x2a":
            raise ImageError("WebP's VP8 data lacks its start code")
        width, height = struct.unpack_from("<HH", data, 26)
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L" and length >= 5:
        if data[20] != 0x2F:
            raise ImageError("WebP's VP8L data lacks its signature")
        (bits,) = struct.unpack_from("<I", data, 21)
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X" and length >= 10:
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    raise ImageError(f"WebP's first chunk ({chunk!r}, {length} bytes) is not VP8, VP8L or VP8X")


def _gif_size(data: bytes) -> tuple[int, int]:
    """The logical screen grown to hold the first image (Pillow's size for the first frame),
    found after at most MAX_HEADER_STEPS blocks and extension sub-blocks."""
    if len(data) < 13:
        raise _truncated("GIF")
    width, height, flags = struct.unpack_from("<HHB", data, 6)
    at = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)  # the global colour table
    in_extension = False
    for _ in range(MAX_HEADER_STEPS):
        if at >= len(data):
            raise ImageError("GIF is truncated before its first image")
        if in_extension:  # a sub-block: its size, then its bytes; size 0 ends the extension
            in_extension = data[at] != 0
            at += 1 + data[at]
        elif data[at] == 0x21:  # an extension: introducer, label, sub-blocks
            at, in_extension = at + 2, True
        elif data[at] == 0x2C:  # the first image descriptor
            if at + 10 > len(data):
                raise ImageError("GIF is truncated in its first image descriptor")
            left, top, image_width, image_height = struct.unpack_from("<4H", data, at + 1)
            return max(width, left + image_width), max(height, top + image_height)
        elif data[at] == 0x3B:
            raise ImageError("GIF has no image before its trailer")
        else:
            raise ImageError(f"GIF has byte 0x{data[at]:02x} at {at}, where a block belongs")
    raise ImageError(f"GIF has no image within {MAX_HEADER_STEPS} blocks")


_SIZES: dict[str, Callable[[bytes], tuple[int, int]]] = {
    "png": _png_size,
    "jpeg": _jpeg_size,
    "webp": _webp_size,
    "gif": _gif_size,
}
_WALKS: dict[str, Callable[[bytes], None]] = {"png": _png_walk, "jpeg": _jpeg_walk}


# ---- the decode -------------------------------------------------------------------------------
def _decode(data: bytes, kind: str, size: tuple[int, int], max_pixels: int) -> Image.Image:
    """The first frame as RGB, decoded by Pillow as `kind` alone, once its size is `size`."""
    Image.MAX_IMAGE_PIXELS = max_pixels  # process-wide; one setting per gateway
    try:
        with Image.open(io.BytesIO(data), formats=[PIL_FORMATS[kind]]) as opened:
            if opened.size != size:
                raise ImageError(
                    f"{kind.upper()} decodes as {opened.size[0]} x {opened.size[1]}, its header"
                    f" says {size[0]} x {size[1]}"
                )
            opened.load()
            return to_rgb(opened)
    except ImageError:
        raise
    except Exception as e:  # any failure of Pillow's on these bytes (OSError, SyntaxError, ...)
        raise ImageError(f"{kind.upper()} cannot be decoded: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__
