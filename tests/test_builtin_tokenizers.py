"""The built-in models' committed tokenizer files are what their build script writes, byte for byte: the
script is the source of the 1.1 MB one-line tokenizer.json, and rebuilding takes about a second."""

import pytest

from diptych_common.builtin.build_tokenizer import BUILT_TOKENIZERS, COMMITTED_DIR, write_tokenizer


@pytest.mark.parametrize("name", BUILT_TOKENIZERS)
def test_the_build_script_reproduces_the_committed_tokenizer_files(name, tmp_path):
    built = write_tokenizer(name, tmp_path)
    committed = COMMITTED_DIR / name
    assert sorted(path.name for path in built.iterdir()) == sorted(path.name for path in committed.iterdir())
    differing = [path.name for path in built.iterdir() if path.read_bytes() != (committed / path.name).read_bytes()]
    assert differing == [], f"run python -m diptych_common.builtin.build_tokenizer {name}"
