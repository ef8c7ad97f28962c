"""Geometry problems on synthetic images, drawn with Pillow: the numbers are in the picture only, the question
in the text. Deterministic for a seed. Prints one JSON line {"png": <base64>, "question": ..., "answer": <int>}.

    python recipes/geo/draw.py '{"seed": 3, "kinds": ["angle", "perimeter"], "size": 128}'

Kinds:
  angle      a triangle with two of its angles written at their corners; the answer is the third angle
  perimeter  a triangle with its three side lengths written beside the sides; the answer is their sum
"""
import base64
import io
import json
import math
import random
import sys

from PIL import Image, ImageDraw

QUESTIONS = {"angle": "What is the angle at C, in degrees?", "perimeter": "What is the perimeter of the triangle?"}


def triangle(rng: random.Random, size: int) -> list[tuple[float, float]]:
    """Three corners inside the square with margins for labels, not too flat (every angle at least 20 degrees)."""
    m = size * 0.18
    while True:
        pts = [(rng.uniform(m, size - m), rng.uniform(m, size - m)) for _ in range(3)]
        if min(angles(pts)) >= 20:
            return pts


def angles(pts: list[tuple[float, float]]) -> list[float]:
    """Interior angles in degrees at each corner."""
    out = []
    for i in range(3):
        (ax, ay), (bx, by), (cx, cy) = pts[i], pts[(i + 1) % 3], pts[(i + 2) % 3]
        u, v = (bx - ax, by - ay), (cx - ax, cy - ay)
        cos = (u[0] * v[0] + u[1] * v[1]) / (math.hypot(*u) * math.hypot(*v))
        out.append(math.degrees(math.acos(max(-1.0, min(1.0, cos)))))
    return out


def draw(seed: int, kinds: list[str], size: int) -> dict:
    rng = random.Random(seed)
    kind = kinds[rng.randrange(len(kinds))]
    if kind not in QUESTIONS:
        raise SystemExit(f"draw.py: kind {kind!r} is not one of {sorted(QUESTIONS)}")
    pts = triangle(rng, size)
    img = Image.new("RGB", (size, size), "white")
    d = ImageDraw.Draw(img)
    d.polygon(pts, outline="black")
    cx, cy = sum(p[0] for p in pts) / 3, sum(p[1] for p in pts) / 3
    away = lambda x, y, k: (x + (x - cx) * k, y + (y - cy) * k)  # a label placed outside the triangle
    for name, (x, y) in zip("ABC", pts):
        d.text(away(x, y, 0.25), name, fill="blue")
    if kind == "angle":
        a, b, _ = [round(t) for t in angles(pts)]  # the drawn triangle's own angles, rounded
        for value, (x, y) in zip((a, b), pts):
            d.text(away(x, y, -0.35), str(value), fill="red")
        answer = 180 - a - b
    else:
        sides = []
        for i in range(3):
            (x1, y1), (x2, y2) = pts[i], pts[(i + 1) % 3]
            sides.append(rng.randint(2, 19))
            d.text(away((x1 + x2) / 2, (y1 + y2) / 2, 0.2), str(sides[-1]), fill="red")
        answer = sum(sides)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return {"png": base64.b64encode(buf.getvalue()).decode(), "question": QUESTIONS[kind], "answer": answer}


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    print(json.dumps(draw(int(args["seed"]), list(args.get("kinds", ["angle", "perimeter"])), int(args.get("size", 128)))))
