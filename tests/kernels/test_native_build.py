"""How the CPU kernels' C (kernels/csrc/) is built: the real files compiled in place, so a compiler
error names the file and line, whole; the cache keyed on every file a kernel includes, so an
edit to a shared header rebuilds each kernel that includes it; and no C left in Python strings."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from radixrt.kernels import cpu_layer, native

needs_compiler = pytest.mark.skipif(native.find_compiler() is None, reason="needs a C compiler")
KERNELS = Path(native.__file__).parent


def _break(path: Path, after: str) -> int:
    """Put a syntax error on the line after the first line that starts with `after`; its number."""
    lines = path.read_text().split("\n")
    at = next(i for i, line in enumerate(lines) if line.startswith(after)) + 1
    lines.insert(at, "int broken = ;")
    path.write_text("\n".join(lines))
    return at + 1


@needs_compiler
def test_a_compiler_error_names_the_file_and_line(tmp_path):
    source = tmp_path / "int8_gemm.c"
    shutil.copy(native.CSRC / "int8_gemm.c", source)
    line = _break(source, "#define SPAN")
    with pytest.raises(native.CompileError) as refused:
        native.compile_library(
            native.find_compiler(), source, native.FLAGS, tmp_path / "int8_gemm.so"
        )
    assert re.search(rf"^{re.escape(str(source))}:{line}:\d+: error", str(refused.value), re.M)
    assert not (tmp_path / "int8_gemm.so").exists()


@needs_compiler
def test_an_error_in_an_included_header_names_the_header(tmp_path):
    """A header beside the source is found before kernels/csrc's (the compiler's order for
    `#include "..."`), and its error names it, through the file that includes it."""
    source, header = tmp_path / "cpu_paged.c", tmp_path / "avx2.h"
    shutil.copy(native.CSRC / "cpu_paged.c", source)
    shutil.copy(native.CSRC / "avx2.h", header)
    line = _break(header, "#include <stdint.h>")
    with pytest.raises(native.CompileError) as refused:
        native.compile_library(native.find_compiler(), source, native.FLAGS, tmp_path / "x.so")
    message = str(refused.value)
    assert re.search(rf"^{re.escape(str(header))}:{line}:\d+: error", message, re.M)
    assert f"from {source}:" in message  # the including file, as the compiler tells it


@needs_compiler
def test_load_logs_the_whole_error_and_falls_back(tmp_path, monkeypatch, caplog):
    """Without the old cut to 500 characters: every error of a source with many is in the log."""
    monkeypatch.setenv("RADIXRT_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "cpu_mask.c"
    errors = "\n".join(f"int broken_{i} = undeclared_{i};" for i in range(20))
    source.write_text((native.CSRC / "cpu_mask.c").read_text() + errors + "\n")
    first = len((native.CSRC / "cpu_mask.c").read_text().split("\n"))
    with caplog.at_level("WARNING", logger=native.__name__):
        assert native.load("broken_mask", source, (("apply_bitmask", ()),)) is None
    (record,) = [r for r in caplog.records if "did not compile" in r.getMessage()]
    message = record.getMessage()
    assert len(message) > 500
    for line in (first, first + 19):
        assert f"{source}:{line}:" in message
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))


def test_the_cache_key_covers_every_included_file(tmp_path):
    (tmp_path / "a.c").write_text('#include "b.h"\n#include <math.h>\nvoid f(void) {}\n')
    (tmp_path / "b.h").write_text('#include "c.h"\n#include "avx2.h" /* from kernels/csrc */\n')
    (tmp_path / "c.h").write_text("#define C 1\n")
    source = tmp_path / "a.c"
    assert native.included(source) == [
        source,
        tmp_path / "b.h",
        tmp_path / "c.h",
        native.CSRC / "avx2.h",
    ]
    key = native.source_key(source, native.FLAGS)
    assert native.source_key(source, native.FLAGS) == key
    assert native.source_key(source, (*native.FLAGS, "-DVNNI")) != key
    (tmp_path / "c.h").write_text("#define C 2\n")  # two includes deep
    assert native.source_key(source, native.FLAGS) != key


def test_the_layer_kernel_is_built_from_the_kernels_own_files():
    names = [p.name for p in native.included(cpu_layer.SOURCE)]
    assert names[0] == "cpu_layer.c"
    assert set(names[1:]) == {"int4_gemm.c", "avx2.h", "int8_gemm.c", "cpu_paged.c", "cpu_fused.c"}


def test_no_c_is_left_in_python_strings():
    c_like = re.compile(r"^\s*#\s*(include|define|pragma)\b|static inline|__m256", re.M)
    for module in sorted(KERNELS.glob("*.py")):
        found = c_like.search(module.read_text())
        assert found is None, f"{module.name} holds C ({found and found.group()}): move it to csrc/"


def test_every_kernel_source_is_a_file_under_csrc():
    sources = {p.name for p in native.CSRC.iterdir() if p.suffix in (".c", ".h")}
    assert {"avx2.h", "cpu_layer.c", "int4_gemm.c", "int8_gemm.c", "cpu_paged.c"} <= sources
    for module in sorted(KERNELS.glob("*.py")):
        for name in re.findall(r'native\.CSRC / "([^"]+)"', module.read_text()):
            assert name in sources, f"{module.name} names csrc/{name}, which is not there"
