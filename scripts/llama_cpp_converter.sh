#!/usr/bin/env bash
# Fetch llama.cpp's own GGUF converter (convert_hf_to_gguf.py, its conversion/ package and the
# gguf-py it imports) from the llama.cpp sources that the llama-cpp-python source distribution
# vendors (the same llama.cpp as `make bench-peers` builds) into DEST, once: the tests make their
# GGUF files with it, as users' files are made.
#   bash scripts/llama_cpp_converter.sh VERSION DEST
set -euo pipefail
version=$1
dest=$2
pip=${PIP:-pip}
test -f "$dest/convert_hf_to_gguf.py" && exit 0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$pip" download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
root="llama_cpp_python-$version/vendor/llama.cpp"
tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work" \
    "$root/convert_hf_to_gguf.py" "$root/conversion" "$root/gguf-py"
mkdir -p "$(dirname "$dest")"
rm -rf "$dest.tmp$$"
mv "$work/$root" "$dest.tmp$$"
mv -T "$dest.tmp$$" "$dest"
echo "llama.cpp's converter ($version) in $dest"
