"""Do a model's frozen visual tokens carry an object's motion over frame sets? (issue 45)

For every object of a SynthDrive sequence set (`litevlm synth --frames K`), the visual token at the
object's cell of the token grid (its camera, the newest set's box centre) is read from each of the K
frame sets, as the pipeline's vision stage makes it (its own preprocessing: the whole frame decoded and resized
bicubically to one tile, normalized; `InternVL.encode_images`). Linear probes (L2 logistic regression, 5 folds
grouped by scene) then predict the ground truth's `moving` from: the newest token alone (appearance),
the newest token plus its differences to the oldest and previous sets (what a model that compares
sets could use), the temporal token selection's change score with the ego's state, and token
matching: where the object's newest token is found again in each older set (the most similar token
within MATCH_RADIUS cells) against where its neighbours' tokens are found (the background's shift,
which the ego's own motion makes), with the ego's state: what a decoder attending across cells
could compute, rather than comparing a cell with itself. Split by
whether the ego moves: with the ego moving every cell changes, and a probe that gains nothing there
says the tokens, not the decoder's training, are what limits a model that is to answer from time.

    .venv/bin/python scripts/studies/motion_probe.py --data runs/data/m-s2031-400 \
        --model litevlm_runtime/bundled/synthdrive-internvl2_5-v2

Why a hand-written probe: the project has no scikit-learn dependency (it comes only with the
OpenVINO peers' nncf), and a logistic regression is 10 lines of torch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from litevlm_runtime.stages.motion import cell_motion, grey_tile
from litevlm_runtime.stages.preprocess import Normalizer, load_image, to_tiles_uint8
from litevlm_runtime.stages.temporal import token_change
from litevlm_runtime.weights.checkpoint import load_model

FOLDS = 5
FLOW_FEATURES = 14      # flow_features' numbers per older set
MATCH_RADIUS = 2        # cells a token is looked for around its own place in an older set


def tile_grey(path: Path, camera: str, tile: int) -> np.ndarray:
    """One camera image as the pipeline's uint8 tile, grey: what the motion network's flow is made from."""
    pixels_u8 = torch.empty(1, 3, tile, tile, dtype=torch.uint8)
    to_tiles_uint8(load_image(path, camera, (tile, tile)), tile, 1, pixels_u8)
    return grey_tile(pixels_u8[0])


def tile_pixels(path: Path, camera: str, tile: int, normalize: Normalizer) -> torch.Tensor:
    """One camera image as the pipeline makes its single tile (pipeline.py: load_image, to_tiles_uint8,
    the Normalizer): [3, tile, tile]."""
    pixels_u8 = torch.empty(1, 3, tile, tile, dtype=torch.uint8)
    to_tiles_uint8(load_image(path, camera, (tile, tile)), tile, 1, pixels_u8)
    return normalize(pixels_u8)[0]


def best_matches(feats: torch.Tensor, grid: int) -> list[tuple[torch.Tensor, ...]]:
    """feats [K, T, D] of one camera over K sets (oldest first), T = grid x grid tokens. For each older
    set, every newest token's best match within MATCH_RADIUS cells: (cosine similarities [T new, T old],
    the match [T], its shift in cells x and y [T]). Once per camera: its objects read their cells."""
    unit = torch.nn.functional.normalize(feats.float(), dim=-1)
    ys, xs = torch.div(torch.arange(grid * grid), grid, rounding_mode="floor"), torch.arange(grid * grid) % grid
    dx, dy = xs[None, :] - xs[:, None], ys[None, :] - ys[:, None]               # [new cell, old cell]
    near = (dx.abs() <= MATCH_RADIUS) & (dy.abs() <= MATCH_RADIUS)
    out = []
    for older in unit[:-1]:
        sim = (unit[-1] @ older.T).masked_fill(~near, -2.0)                     # [T new, T old]
        best = sim.argmax(1)
        out.append((sim, best, dx.gather(1, best[:, None])[:, 0].float(), dy.gather(1, best[:, None])[:, 0].float()))
    return out


def token_matching(matches: list[tuple[torch.Tensor, ...]], grid: int, cell: int) -> np.ndarray:
    """For each older set (best_matches): the object's cell's cosine similarity to the same cell, its best
    match's similarity and shift (cells, x and y), the median shift of the other cells within MATCH_RADIUS
    of it (the background's), and the object's shift less the background's: [8 x (K - 1)]."""
    ys, xs = torch.div(torch.arange(grid * grid), grid, rounding_mode="floor"), torch.arange(grid * grid) % grid
    cy, cx = divmod(cell, grid)
    around = ((ys - cy).abs() <= MATCH_RADIUS) & ((xs - cx).abs() <= MATCH_RADIUS)
    around[cell] = False
    out = []
    for sim, best, shift_x, shift_y in matches:
        bg_x, bg_y = shift_x[around].median().item(), shift_y[around].median().item()
        out += [sim[cell, cell].item(), sim[cell, best[cell]].item(), shift_x[cell].item(), shift_y[cell].item(),
                bg_x, bg_y, shift_x[cell].item() - bg_x, shift_y[cell].item() - bg_y]
    return np.array(out, dtype=float)


def pixel_cells(pixels: torch.Tensor, grid: int) -> torch.Tensor:
    """pixels [K, 3, tile, tile] as the grid x grid cells' raw pixels, [K, grid * grid, 3 * cell * cell]: the
    tokens' places without the vision tower (--pixels), to tell what the tower loses from what the grid
    cannot hold."""
    k, c, tile, _ = pixels.shape
    cell = tile // grid
    return (pixels.reshape(k, c, grid, cell, grid, cell).permute(0, 2, 4, 1, 3, 5)
            .reshape(k, grid * grid, c * cell * cell))


def grey_frames(files: list[Path], width: int) -> list[np.ndarray]:
    """The frames grey, resized to `width` px wide (OpenCV, the project's image library)."""
    import cv2

    grey = []
    for f in files:
        img = cv2.imread(str(f), cv2.IMREAD_GRAYSCALE)
        grey.append(cv2.resize(img, (width, round(img.shape[0] * width / img.shape[1])), interpolation=cv2.INTER_AREA))
    return grey


def camera_flows(grey: list[np.ndarray]) -> list[np.ndarray]:
    """Dense optical flow (OpenCV's Farneback) from the newest grey frame to each older one: for each
    newest pixel, where it was in that set, [H, W, 2] each (oldest first). Motion finer than the token
    grid (--flow), to tell whether it holds the object's."""
    import cv2

    return [cv2.calcOpticalFlowFarneback(grey[-1], older, None, 0.5, 4, 15, 3, 5, 1.2, 0) for older in grey[:-1]]


def flow_features(flows: list[np.ndarray], bbox: list[float], image_width: int) -> np.ndarray:
    """Per older set: the median flow inside the object's newest box (x, y), the median flow of a band
    as wide as the box just below it (the ground it stands on, at its depth: what a still object's
    flow would be), of the ring around the box, and the box's flow less each, its spread (a box that
    grows or shrinks) and the lengths of the two differences: [14 x (K - 1)], in pixels of the full frame."""
    out = []
    for flow in flows:
        h, w = flow.shape[:2]
        k = w / image_width
        x0, y0, x1, y1 = (int(round(v * k)) for v in bbox)
        x0, y0, x1, y1 = max(0, x0), max(0, y0), min(w, max(x1, x0 + 1)), min(h, max(y1, y0 + 1))
        bh, bw = max(1, y1 - y0), max(1, x1 - x0)
        inside = flow[y0:y1, x0:x1].reshape(-1, 2)
        below = flow[y1:min(h, y1 + max(2, bh // 3)), x0:x1].reshape(-1, 2)
        ring_mask = np.zeros((h, w), bool)
        ring_mask[max(0, y0 - bh // 2):min(h, y1 + bh // 2), max(0, x0 - bw // 2):min(w, x1 + bw // 2)] = True
        ring_mask[y0:y1, x0:x1] = False
        ring = flow[ring_mask]
        med = np.median(inside, 0)
        ground = np.median(below, 0) if len(below) else med
        around = np.median(ring, 0) if len(ring) else med
        out += [*med, *ground, *around, *(med - ground), *(med - around), *inside.std(0),
                np.linalg.norm(med - ground), np.linalg.norm(med - around)]
    return np.array(out, dtype=float) / k


def object_rows(data: Path, model, tile: int, limit: int, pixels_grid: int = 0, flow_width: int = 0) -> list[dict]:
    """Per object: scene, labels, the ego's state, its token over the K sets and the change score."""
    truth = json.loads((data / "ground_truth.json").read_text())
    normalize = Normalizer(torch.float32, torch.device("cpu"))
    rows = []
    for n, g in enumerate(tqdm(list(truth.values())[:limit], desc="scenes", unit="scene")):
        feats, matches, flows, cells = {}, {}, {}, {}
        for obj in g["objects"]:
            cam = obj["camera"]
            if cam not in feats:
                files = sorted((data / "samples" / cam).glob(f"*-{g['index']:06d}__{cam}__*.jpg"))   # oldest first
                with torch.inference_mode():
                    pixels = torch.stack([tile_pixels(f, cam, tile, normalize) for f in files])
                    feats[cam] = (pixel_cells(pixels, pixels_grid) if pixels_grid
                                  else model.encode_images(pixels))                          # [K, T, D]
            if flow_width and cam not in flows:
                flows[cam] = camera_flows(grey_frames(files, flow_width))
            grid = int(round(feats[cam].shape[1] ** 0.5))       # 8 x 8 at 224 px, 16 x 16 at 448 px
            if cam not in cells:        # the motion network's input (stages/motion.py): newest vs the set before
                cells[cam] = cell_motion(tile_grey(files[-1], cam, tile), tile_grey(files[-2], cam, tile), grid)
            if cam not in matches:
                matches[cam] = best_matches(feats[cam], grid)
            width, height = g["image_size"]
            cx, cy = obj["cameras"][cam]["centre"]
            cell = min(grid - 1, int(cy / height * grid)) * grid + min(grid - 1, int(cx / width * grid))
            f = feats[cam][:, cell, :].float().numpy()
            rows.append({"scene": n, "moving": obj["motion"]["moving"], "ego_moving": g["ego"]["speed_mps"] > 0.5,
                         "newest": f[-1], "differences": np.concatenate([f[-1] - f[0], f[-1] - f[-2]]),
                         "change": float(token_change(feats[cam][0], feats[cam][-1])[cell]),
                         "matching": token_matching(matches[cam], grid, cell),
                         "ego_speed": g["ego"]["speed_mps"], "cell_motion": cells[cam][cell].numpy(),
                         "truth": [obj["motion"]["closing_mps"], obj["motion"]["lateral_mps"], obj["distance_m"]],
                         "flow": (np.concatenate([flow_features(flows[cam], obj["cameras"][cam]["bbox"], width),
                                                  obj["cameras"][cam]["bbox"]])
                                  if flow_width else np.zeros(0))})
    return rows


def fit_predict(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, l2: float = 1e-2) -> np.ndarray:
    """L2-regularized logistic regression (standardized features, LBFGS); the test rows' labels."""
    mean, std = x_train.mean(0), x_train.std(0) + 1e-6
    xt = torch.tensor((x_train - mean) / std, dtype=torch.float64)
    yt = torch.tensor(y_train, dtype=torch.float64)
    w = torch.zeros(xt.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(xt @ w + b, yt) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return ((torch.tensor((x_test - mean) / std, dtype=torch.float64) @ w + b) > 0).numpy()


def fit_predict_mlp(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, hidden: int = 64,
                    steps: int = 600, seed: int = 0) -> np.ndarray:
    """A small two-layer network (standardized features, Adam, weight decay) for cues that are products
    of features (a box's growth against its size and the ego's speed), which a linear probe cannot form."""
    torch.manual_seed(seed)
    mean, std = x_train.mean(0), x_train.std(0) + 1e-6
    xt = torch.tensor((x_train - mean) / std, dtype=torch.float32)
    yt = torch.tensor(y_train, dtype=torch.float32)
    net = torch.nn.Sequential(torch.nn.Linear(xt.shape[1], hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 1))
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(net(xt)[:, 0], yt).backward()
        opt.step()
    with torch.no_grad():
        return (net(torch.tensor((x_test - mean) / std, dtype=torch.float32))[:, 0] > 0).numpy()


def grouped_accuracy(x: np.ndarray, y: np.ndarray, groups: np.ndarray, fit=fit_predict) -> float:
    """Accuracy over FOLDS folds of whole scenes (a scene's objects never in train and test at once)."""
    fold_of = {g: i % FOLDS for i, g in enumerate(np.unique(groups))}
    fold = np.array([fold_of[g] for g in groups])
    right = 0
    for k in range(FOLDS):
        test = fold == k
        right += int((fit(x[~test], y[~test], x[test]) == y[test]).sum())
    return right / len(y)


def time_flow(data: Path, model, tile: int, widths: list[int], rounds: int = 5) -> None:
    """ms per camera of the flow between two frame sets at each width against the vision tower on the
    camera's one tile, alternating in rounds in this process (a ratio, not a figure for another machine)."""
    import time

    files = sorted((data / "samples" / "CAM_FRONT").glob("*-000000__CAM_FRONT__*.jpg"))[-2:]
    pixels = tile_pixels(files[-1], "CAM_FRONT", tile, Normalizer(torch.float32, torch.device("cpu")))[None]
    grey = {w: grey_frames(files, w) for w in widths}          # decoded once: the pipeline has its frames
    runs = {f"flow at {w} px": (lambda w=w: camera_flows(grey[w])) for w in widths}
    runs[f"vision tower, one {tile} px tile"] = lambda: model.encode_images(pixels)
    spent = {name: [] for name in runs}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, run in runs.items():
                t0 = time.perf_counter()
                run()
                spent[name].append((time.perf_counter() - t0) * 1e3)
    base = float(np.median(spent[f"vision tower, one {tile} px tile"]))
    print(f"| per camera ({rounds} alternating rounds, {torch.get_num_threads()} threads) | ms, median | x vision |")
    print("|---|---|---|")
    for name, ms in spent.items():
        print(f"| {name} | {np.median(ms):.2f} | {np.median(ms) / base:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="a SynthDrive sequence folder (synth --frames K)")
    ap.add_argument("--model", required=True, help="model folder whose vision side makes the tokens")
    ap.add_argument("--scenes", type=int, default=400)
    ap.add_argument("--tile", type=int, default=224,
                    help="tile size in pixels (the position embedding interpolated, as InternViT does)")
    ap.add_argument("--pixels", type=int, default=0, metavar="GRID",
                    help="probe the raw pixels of a GRID x GRID grid of cells instead of the tokens")
    ap.add_argument("--flow", type=int, default=0, metavar="WIDTH",
                    help="also probe dense optical flow (OpenCV Farneback) of the frames resized to WIDTH px")
    ap.add_argument("--time-flow", type=int, nargs="*", metavar="WIDTH",
                    help="only time the flow at these widths against the vision tower on one tile")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model).eval()
    if args.time_flow:
        return time_flow(args.data, model, args.tile, args.time_flow)
    rows = [r for r in object_rows(args.data, model, args.tile, args.scenes, args.pixels, args.flow)
            if r["moving"] is not None]
    y = np.array([r["moving"] for r in rows], dtype=float)
    groups = np.array([r["scene"] for r in rows])
    ego = np.array([r["ego_moving"] for r in rows])
    newest = np.stack([r["newest"] for r in rows])
    both = np.concatenate([newest, np.stack([r["differences"] for r in rows])], 1)
    change = np.array([[r["change"], r["ego_moving"]] for r in rows], dtype=float)
    matching = np.stack([np.concatenate([r["matching"], [r["ego_moving"], r["ego_speed"]]]) for r in rows])
    flow = np.stack([np.concatenate([r["flow"], [r["ego_moving"], r["ego_speed"]]]) for r in rows])
    nearest = flow[:, -(FLOW_FEATURES + 6):]        # the newest set against the one before it, box, ego
    cell_flow = np.stack([np.concatenate([r["cell_motion"], [r["ego_moving"], r["ego_speed"]]]) for r in rows])
    truth = np.stack([np.concatenate([r["truth"], [r["ego_moving"], r["ego_speed"]]]) for r in rows])
    source = (f"raw pixels, {args.pixels} x {args.pixels} cells of a {args.tile} px tile" if args.pixels
              else f"tokens of {args.model}")
    print(f"\n{len(rows)} objects over {len(set(groups))} scenes of {args.data}; {source}")
    flow_columns = (f" optical flow at {args.flow} px + box + ego state | the same, two-layer network "
                    "| the same, nearest set only, two-layer network |") if args.flow else ""
    print("| objects | n | majority | newest token | + differences to older sets | change score + ego state "
          "| token matching + ego state |" + flow_columns
          + " the motion network's cell features + ego state, two-layer network"
          " | ceiling: true closing and lateral speed, distance, ego state, two-layer network |")
    print("|---|---|---|---|---|---|---|" + ("---|---|---|" if args.flow else "") + "---|---|")
    for name, m in (("all", np.ones(len(y), bool)), ("ego stopped", ~ego), ("ego moving", ego)):
        share = y[m].mean()
        linear = (newest, both, change, matching) + ((flow,) if args.flow else ())
        cells = [grouped_accuracy(x[m], y[m], groups[m]) for x in linear]
        if args.flow:
            cells += [grouped_accuracy(x[m], y[m], groups[m], fit_predict_mlp) for x in (flow, nearest)]
        cells.append(grouped_accuracy(cell_flow[m], y[m], groups[m], fit_predict_mlp))
        cells.append(grouped_accuracy(truth[m], y[m], groups[m], fit_predict_mlp))
        print(f"| {name} | {m.sum()} | {max(share, 1 - share):.3f} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
