#!/usr/bin/env bash
# cli_red_team_test.sh MHA -- issue 38's red-team findings in the `mha`
# command, one block each: an output that names an input (any spelling, a
# symlink, a hard link) is refused and the input left as it was; decode's
# --window replaces the file's window; messages that say what was wrong.
# Inputs are made by `mha init` and NumPy (Debian's /usr/bin/python3);
# expected values come from the single-process commands or NumPy, never
# from constants.
set -u
mha="$1"
py=/usr/bin/python3
fails=0; passes=0
ok()   { passes=$((passes + 1)); }
bad()  { echo "FAIL: $*"; fails=$((fails + 1)); }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cd "$tmp" || exit 1

# refuse PATTERN FILE -- command...: exits 1, says PATTERN, FILE unchanged
refuse() {
  local pat="$1" keep="$2"; shift 3
  local before out rc
  before=$(sha256sum < "$keep")
  out=$(timeout 60 "$@" 2>&1); rc=$?
  if [ "$rc" -ne 1 ]; then bad "$* exited $rc, expected 1: $out"; return; fi
  if ! grep -qE -- "$pat" <<<"$out"; then bad "$*: message lacks /$pat/: $out"; return; fi
  if [ "$(sha256sum < "$keep")" != "$before" ]; then bad "$*: $keep changed"; return; fi
  ok
}

"$mha" init --embed-dim 8 --heads 2 --seed 1 --out w.st >/dev/null || bad "init"
"$py" - <<'PY' || bad "numpy inputs"
import numpy as np
rng = np.random.default_rng(0)
np.save("q.npy", rng.standard_normal((5, 8)).astype(np.float32))
np.save("k.npy", rng.standard_normal((7, 8)).astype(np.float32))
np.save("dy.npy", rng.standard_normal((5, 8)).astype(np.float32))
np.save("s.npy", np.array([0.5, 0.25], np.float32))
np.save("x.npy", rng.standard_normal((1, 8)).astype(np.float32))
PY
mkdir -p sub
ln -s ../w.st sub/wlink.st
ln w.st whard.st

# ---- finding 3: an output naming an input ----------------------------------
same_msg="names the same file as"
refuse "$same_msg" w.st -- "$mha" backward --weights w.st --query q.npy \
  --grad-output dy.npy --out ./w.st
refuse "$same_msg" w.st -- "$mha" backward --weights w.st --query q.npy \
  --grad-output dy.npy --out sub/wlink.st
refuse "$same_msg" w.st -- "$mha" backward --weights w.st --query q.npy \
  --grad-output dy.npy --out whard.st
refuse "$same_msg" dy.npy -- "$mha" backward --weights w.st --query q.npy \
  --grad-output dy.npy --out sub/../dy.npy
refuse "$same_msg" q.npy -- "$mha" forward --weights w.st --query q.npy \
  --out q.npy
refuse "$same_msg" k.npy -- "$mha" forward --weights w.st --query q.npy \
  --key k.npy --attn-weights "$tmp/k.npy" --out o.npy
refuse "$same_msg" s.npy -- "$mha" forward --weights w.st --query q.npy \
  --alibi-slopes s.npy --out s.npy
refuse "$same_msg" x.npy -- "$mha" decode --weights w.st --query x.npy \
  --out x.npy
refuse "$same_msg" w.st -- "$mha" prune --weights w.st --keep 0 --out w.st
refuse "$same_msg" s.npy -- "$mha" init --embed-dim 8 --heads 2 --seed 1 \
  --alibi-slopes s.npy --out s.npy
refuse "$same_msg" q.npy -- "$mha" viz --weights w.st --query q.npy \
  --png q.npy
refuse "name the same file" q.npy -- "$mha" forward --weights w.st \
  --query q.npy --attn-weights o.npy --out ./o.npy
[ -e o.npy ] && bad "a refused forward wrote o.npy"

# ---- finding 7: a scale whose scores overflow float32 ----------------------
# (the float64 result is finite; NaN rows with exit 0 were the defect)
refuse "scale 1e\+38" q.npy -- "$mha" forward --weights w.st --query q.npy \
  --scale 1e38 --out o.npy
"$mha" init --embed-dim 8 --heads 2 --seed 1 --scale 3e38 --out big.st >/dev/null ||
  bad "init --scale 3e38"
refuse "scale 3e\+38" q.npy -- "$mha" forward --weights big.st --query q.npy \
  --out o.npy
refuse "scale 3e\+38" q.npy -- "$mha" decode --weights big.st --query q.npy \
  --out o.npy
[ -e o.npy ] && bad "a refused scale wrote o.npy"

# ---- finding 4: decode's --window replaces the file's window ---------------
# wwin.st carries the window (2, 0); `decode --window 5` must attend to the
# 5 keys up to each query (forward --causal --window 4,0, whose --window
# replaces the file's), and `--window -1,-1` to all of them.
"$mha" init --embed-dim 8 --heads 2 --seed 1 --window 2,0 --out wwin.st >/dev/null ||
  bad "init --window"
"$py" -c 'import numpy as np; np.save("x8.npy", np.random.default_rng(5).standard_normal((9, 8)).astype(np.float32))'
close() {  # close A B WHAT: within 1e-5 (1 + max|B|) (float rounding of
           # a cache walk against one forward; a wrong window is O(0.1))
  "$py" - "$1" "$2" "$3" <<'PY' && ok || bad "$3"
import sys
import numpy as np
a, b = np.load(sys.argv[1]), np.load(sys.argv[2])
err = float(np.abs(a - b).max())
if a.shape != b.shape or not err <= 1e-5 * (1 + float(np.abs(b).max())):
    print("%s: error %g" % (sys.argv[3], err))
    sys.exit(1)
PY
}
for w in "5:4,0" "-1,-1:-1,-1" "2,0:2,0"; do
  rm -f d.npy f.npy
  "$mha" decode --weights wwin.st --query x8.npy --window "${w%%:*}" \
    --out d.npy >/dev/null 2>&1 || bad "decode --window ${w%%:*}"
  "$mha" forward --weights wwin.st --query x8.npy --causal \
    --window "${w##*:}" --out f.npy >/dev/null 2>&1 || bad "forward --window ${w##*:}"
  close d.npy f.npy "decode --window ${w%%:*} against forward --window ${w##*:}"
done

# ---- finding 10: messages that say what was wrong --------------------------
# A nonzero value that rounds to 0 (or a theta to 1) in float32 says so.
refuse "rounds to 0 in float32" q.npy -- "$mha" forward --weights w.st \
  --query q.npy --softcap 1e-46 --out o.npy
refuse "rounds to 0 in float32" q.npy -- "$mha" forward --weights w.st \
  --query q.npy --rope neox --rope-scale 1e-46 --out o.npy
refuse "rounds to 1 in float32" q.npy -- "$mha" forward --weights w.st \
  --query q.npy --rope neox --rope-theta 1.00000001 --out o.npy
refuse "must be > 1, got '0.5'" q.npy -- "$mha" forward --weights w.st \
  --query q.npy --rope neox --rope-theta 0.5 --out o.npy
# A file whose k_proj and v_proj disagree in rows names both (not one of
# them with a shape grouped-query attention does not require).
"$py" - <<'PY' || bad "gqa file"
import json, struct
import numpy as np
rng = np.random.default_rng(2)
t = {"q_proj_weight": (16, 16), "k_proj_weight": (8, 16),
     "v_proj_weight": (4, 16), "out_proj.weight": (16, 16)}
hdr, blobs, off = {}, [], 0
for name, shape in t.items():
    b = rng.standard_normal(shape).astype(np.float32).tobytes()
    hdr[name] = {"dtype": "F32", "shape": list(shape),
                 "data_offsets": [off, off + len(b)]}
    off += len(b)
    blobs.append(b)
hdr["__metadata__"] = {"num_heads": "4"}
h = json.dumps(hdr).encode()
h += b" " * (-len(h) % 8)
open("gqa_bad.st", "wb").write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
np.save("q16.npy", rng.standard_normal((3, 16)).astype(np.float32))
PY
refuse "k_proj_weight has 8 rows and v_proj_weight 4" q16.npy -- "$mha" \
  forward --weights gqa_bad.st --query q16.npy --out o.npy
[ -e o.npy ] && bad "a refused forward wrote o.npy"

echo "$passes passed, $fails failed"
[ "$fails" -eq 0 ]
