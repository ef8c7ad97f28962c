"""Images for vision-language policies (Qwen-VL style: placeholder tokens filled by a vision tower, M-RoPE).

An image is processed once, by the engine's /images endpoint with the model's own image processor, and the
processed tensors (pixel_values float32 [patches, dim], image_grid_thw int64 [1, 3]) are written to
<dir>/<sha256 of their bytes>.safetensors: content-addressed, so an image used in several turns or segments of an
episode is one file, and a retried write is the same write. Generate requests and trajectory segments name these
files; the engine and the actor both feed the stored tensors to the model, so the actor trains on exactly what the
engine saw and nothing is ever re-processed (at another resolution, by another library version).
"""
import base64
import hashlib
import io
import os
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file, save

MAX_IMAGE_BYTES = 8 * 1024 * 1024
MAX_IMAGE_PIXELS = 4096 * 4096  # before resizing: a larger image is refused, not decoded
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


def image_token_id(model) -> int | None:
    """The placeholder id of a vision-language model; None for a text-only one."""
    return getattr(model.config, "image_token_id", None) if hasattr(model.config, "vision_config") else None


def vision_token_ids(config) -> list[int]:
    """Ids the policy never samples: a placeholder or vision marker it wrote would claim an image that is not there."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return [getattr(config, n) for n in names if getattr(config, n, None) is not None]


def process_image(processor, data: bytes) -> dict[str, torch.Tensor]:
    """Decode and process one image; a ValueError says what is wrong with it."""
    from PIL import Image
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"image is {len(data)} bytes, over the limit of {MAX_IMAGE_BYTES}")
    try:
        img = Image.open(io.BytesIO(data))
        fmt = img.format
        if fmt in FORMATS and img.width * img.height <= MAX_IMAGE_PIXELS:
            img = img.convert("RGB")
    except Exception as e:
        raise ValueError(f"image does not decode: {type(e).__name__}: {e}") from None
    if fmt not in FORMATS:
        raise ValueError(f"image format {fmt} is not supported (only {', '.join(FORMATS)})")
    if img.width * img.height > MAX_IMAGE_PIXELS:
        raise ValueError(f"image is {img.width}x{img.height} pixels, over the limit of {MAX_IMAGE_PIXELS}")
    out = processor(images=[img], return_tensors="pt")
    return {"pixel_values": out["pixel_values"].float().contiguous(), "image_grid_thw": out["image_grid_thw"].long()}


def store_image(processor, config, req) -> dict:
    """POST /images for either engine backend: process the image once and store it content-addressed; generate
    requests and trajectories then name the file. config: the model's HF config (its merge size)."""
    tensors = process_image(processor, decode_base64(req.data))
    grid = tensors["image_grid_thw"]
    return {"path": save_image(req.dir, tensors), "grid_thw": grid[0].tolist(),
            "tokens": int(grid.prod()) // config.vision_config.spatial_merge_size ** 2}


def save_image(directory: str, tensors: dict[str, torch.Tensor]) -> str:
    """Write the processed tensors to <directory>/<sha256>.safetensors (atomically) and return that path."""
    data = save(tensors)
    path = Path(directory) / f"{hashlib.sha256(data).hexdigest()}.safetensors"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # one temp file per writer: the engine serves concurrent requests, and two may bring the same image
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(path)
    return str(path)


def load_image(path: str, what: str) -> dict[str, torch.Tensor]:
    """The processed tensors of one image file, checked (sha256 name, shapes); a ValueError names `what`."""
    try:
        raw = Path(path).read_bytes()
        tensors = load_file(path)
    except Exception as e:
        raise ValueError(f"{what}: image {path!r} is unreadable: {e}") from None
    if Path(path).stem != hashlib.sha256(raw).hexdigest():
        raise ValueError(f"{what}: image {path!r} does not match its sha256 name (corrupted)")
    grid, pixels = tensors.get("image_grid_thw"), tensors.get("pixel_values")
    if grid is None or pixels is None or list(grid.shape) != [1, 3] or pixels.dim() != 2 or \
            pixels.shape[0] != int(grid.prod()):
        raise ValueError(f"{what}: image {path!r} needs pixel_values [patches, dim] and image_grid_thw [1, 3]")
    return tensors


def placeholders(model, images: list[dict]) -> int:
    """How many placeholder tokens these images fill (the processor's expansion: patches / merge^2)."""
    merge = model.config.vision_config.spatial_merge_size
    return sum(int(im["image_grid_thw"].prod()) // merge ** 2 for im in images)


def check_placeholders(model, ids: list[int], images: list[dict], what: str) -> None:
    image_id = image_token_id(model)
    if image_id is None:
        if images:
            raise ValueError(f"{what}: images given, but the model is not a vision-language model")
        return
    have, need = ids.count(image_id), placeholders(model, images)
    if have != need:
        raise ValueError(f"{what}: {have} image placeholder tokens (id {image_id}), the {len(images)} image(s) "
                         f"fill {need}")


def vision_inputs(model, input_ids: torch.Tensor, images: list[dict]) -> dict:
    """The extra forward arguments for rows input_ids [b, L] whose images (in row order, then order of appearance)
    are `images`: pixel values, grids, and the token types M-RoPE positions come from. {} without images."""
    if not images:
        return {}
    device = input_ids.device
    return {"pixel_values": torch.cat([im["pixel_values"] for im in images]).to(device),
            "image_grid_thw": torch.cat([im["image_grid_thw"] for im in images]).to(device),
            "mm_token_type_ids": (input_ids == image_token_id(model)).int()}


def decode_base64(data: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except ValueError:
        raise ValueError("image data is not valid base64") from None
