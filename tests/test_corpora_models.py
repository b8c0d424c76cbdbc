"""Real corpora from the registries and the embedded SmolLM2, resolved to an HF folder."""

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
