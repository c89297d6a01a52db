"""A GGUF's tokenizer (`executor/gguf_tokenizer.py`, built from the file's `tokenizer.ggml.*`)
against llama.cpp's own, `llama-tokenize` (built by `make test` outside the checkout), on the
same files, token for token, with and without the BOS the file asks for, on multilingual, code
and whitespace-heavy text; and against the tool that wrote the vocabulary where it is here.
The vocabulary types:
- byte-level BPE (`gpt2`): the default model's file (SmolLM2's, split as llama.cpp's `smollm`);
- SentencePiece (`llama`): a BPE model trained here with sentencepiece (byte fallback, digits
  split), in tiny Llama and Gemma 3 checkpoints converted by llama.cpp's converter (Llama's file
  asks for a space prefix, Gemma's does not); Llama's ids also equal sentencepiece's own.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from radixrt.bench.peers import llama_cpp_tool
from radixrt.executor import gguf_file, gguf_tokenizer
from radixrt.executor.model_loader import default_gguf_path

from helpers import TINY

CONVERTER = Path(os.environ.get("RADIXRT_LLAMA_CPP_CONVERTER", "/nonexistent"))
LLAMA_TOKENIZE = llama_cpp_tool("llama-tokenize")
needs_llama_cpp = pytest.mark.skipif(
    LLAMA_TOKENIZE is None or not (CONVERTER / "convert_hf_to_gguf.py").is_file(),
    reason="llama.cpp's tokenizer and converter: `make test` builds and fetches them",
)
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "über café naïve — 東京 大阪 привет мир 🙂 ÆØÅ",
    "def f(x):\n    return x**2  # square\n\n\tif x:\n\t\tprint(x)\n",
    "   leading and   inner    spaces   \n\n\n  trailing  ",
    "numbers 0 1 2 3 42 100 3.14159 1,000,000 and 12345678",
    '{"key": [1, 2.5, null], "k2": "v\\u00e9"}',
    " ",
    "\n",
    "",
]
WORDS = (
    "the quick brown fox jumps over lazy dog über café naïve 東京 大阪 привет мир def return "
    "import class self print while for if else 0 1 2 3 42 100"
).split()


def llama_cpp_ids(path: Path, text: str, bos: bool, tmp_path: Path) -> list[int]:
    """llama-tokenize's ids for `text` (special tokens not parsed: the text is plain)."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(text)
    argv = [str(LLAMA_TOKENIZE), "-m", str(path), "-f", str(prompt), "--ids", "--log-disable"]
    argv += ["--no-parse-special"] + ([] if bos else ["--no-bos"])
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60)
    ids: list[int] = json.loads(out.stdout.strip().splitlines()[-1])
    return ids


@pytest.fixture(scope="module")
def sentencepiece_files(tmp_path_factory) -> dict[str, Path]:
    """model type -> a tiny checkpoint of it with a trained SentencePiece BPE vocabulary,
    converted by llama.cpp's converter; "model" -> the vocabulary itself."""
    import sentencepiece

    root = tmp_path_factory.mktemp("spm")
    rng = random.Random(0)
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choices(WORDS, k=12)) for _ in range(3000)))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(root / "tok"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        minloglevel=2,
    )
    made = {"model": root / "tok.model"}
    for model_type, tokenizer_class, extra in (
        ("llama", "LlamaTokenizer", {}),
        ("gemma3_text", "GemmaTokenizer", {"head_dim": 32}),
    ):
        folder = root / model_type
        shape = {**TINY, "vocab_size": 400, "bos_token_id": 1, "eos_token_id": 2}
        config = AutoConfig.for_model(model_type, **shape, max_position_embeddings=256, **extra)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        shutil.copy(made["model"], folder / "tokenizer.model")
        spec = {"tokenizer_class": tokenizer_class, "add_bos_token": True}
        (folder / "tokenizer_config.json").write_text(json.dumps(spec))
        made[model_type] = root / f"{model_type}.gguf"
        subprocess.run(
            [sys.executable, "convert_hf_to_gguf.py", str(folder), "--outtype", "f32"]
            + ["--outfile", str(made[model_type])],
            cwd=CONVERTER,
            env={**os.environ, "PYTHONPATH": f"{CONVERTER / 'gguf-py'}:{CONVERTER}"},
            check=True,
            capture_output=True,
            timeout=300,
        )
    return made


def assert_same_as_llama_cpp(path: Path, tmp_path: Path) -> None:
    tokenizer = gguf_tokenizer.build(gguf_file.read(path))
    for text in TEXTS:
        for bos in (True, False):
            ours = tokenizer.encode(text, add_special_tokens=bos)
            assert ours == llama_cpp_ids(path, text, bos, tmp_path), (text, bos)


@needs_llama_cpp
def test_a_byte_level_vocabulary_tokenizes_as_llama_cpp(tmp_path):
    assert_same_as_llama_cpp(default_gguf_path(), tmp_path)


@needs_llama_cpp
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_a_sentencepiece_vocabulary_tokenizes_as_llama_cpp(
    sentencepiece_files, model_type, tmp_path
):
    """Spaces included: a Llama file's text gets one `▁` more in front (its space prefix), as
    sentencepiece writes it; transformers' Metaspace gave " " one where llama.cpp has two."""
    assert_same_as_llama_cpp(sentencepiece_files[model_type], tmp_path)
    if model_type == "llama":
        import sentencepiece

        writer = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_files["model"]))
        tokenizer = gguf_tokenizer.build(gguf_file.read(sentencepiece_files[model_type]))
        for text in TEXTS:
            assert tokenizer.encode(text, add_special_tokens=False) == writer.encode(text), text


def _byte_level_file(path: Path, merges: list[str] | None, **ids: int) -> Path:
    """A file with only a byte-level vocabulary: a, b, ab, c and two specials."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab", "c", "<s>", "</s>"])
    writer.add_token_types([1, 1, 1, 1, 3, 3])
    if merges is not None:
        writer.add_token_merges(merges)
    writer.add_bos_token_id(ids.get("bos", 4))
    writer.add_eos_token_id(ids.get("eos", 5))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("merges", "ids", "words"),
    [
        (["a b"], {}, None),
        (None, {}, "needs tokenizer.ggml.merges"),
        (["a c"], {}, "merges[0] 'a c' is not two tokens"),
        (["a  b"], {}, "merges[0] 'a  b' is not two tokens"),
        (["a b"], {"eos": 6}, "eos_token_id 6 is not a token's id"),
    ],
)
def test_tokenizer_metadata_the_builders_would_fail_on_is_refused_by_name(
    tmp_path, merges, ids, words
):
    """A merge of tokens the vocabulary lacks ended in tokenizers' bare Exception; a byte-level
    vocabulary without merges had them derived (a minute at 49k); an id past the vocabulary
    named nothing: each is one line naming the file and the field."""
    file = gguf_file.read(_byte_level_file(tmp_path / "v.gguf", merges, **ids))
    if words is None:
        assert gguf_tokenizer.build(file).encode("abc", add_special_tokens=False) == [2, 3]
        return
    with pytest.raises(ValueError, match="^v.gguf: ") as refused:
        gguf_tokenizer.build(file)
    assert words in str(refused.value) and "\n" not in str(refused.value)
