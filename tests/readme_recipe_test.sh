#!/usr/bin/env bash
# The README's recipe that needs no PyTorch (`mha init`, an input from
# NumPy, `mha forward`, `mha viz --ascii`): the sh block after the marker
# "checked by tests/readme_recipe_test.sh" runs as written, with `mha`
# this build's command and `python3` Debian's (python3-numpy), and its
# output must be the drawing it promises: four causal heads and their mean.
set -u
mha="$1"; here="$(cd "$(dirname "$0")" && pwd)"
readme="$here/../README.md"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/bin"
ln -s "$mha" "$tmp/bin/mha"
ln -s /usr/bin/python3 "$tmp/bin/python3"

# the fenced block right after the marker
awk '/checked by tests\/readme_recipe_test.sh/ {m = 1; next}
     m == 1 && /^```sh$/ {m = 2; next}
     m == 2 && /^```$/ {exit}
     m == 2 {print}' "$readme" > "$tmp/recipe.sh"
if [ "$(grep -c '^mha ' "$tmp/recipe.sh")" -ne 3 ]; then
  echo "FAIL: the README's recipe block was not found or changed shape:"
  cat "$tmp/recipe.sh"; exit 1
fi
out=$(cd "$tmp" && PATH="$tmp/bin:$PATH" bash -e recipe.sh 2>&1); rc=$?
if [ "$rc" -ne 0 ]; then echo "FAIL: the recipe exited $rc: $out"; exit 1; fi
for f in w.safetensors x.npy y.npy; do
  [ -s "$tmp/$f" ] || { echo "FAIL: the recipe wrote no $f"; exit 1; }
done
# Four heads and the mean; 8 rows per panel; causal: row 1 has one shaded
# cell (key 1, weight 1: the largest, so '█') and nothing after it.
for t in "head 0" "head 3" "mean"; do
  grep -q "$t" <<<"$out" || { echo "FAIL: no panel '$t': $out"; exit 1; }
done
row1=$(grep -E '^1 \[' <<<"$out" | head -1)
if ! grep -qE '^1 \[ █ {15}\]' <<<"$row1"; then
  echo "FAIL: row 1 of head 0 is not causal (only key 1, weight 1): '$row1'"
  exit 1
fi
[ "$(grep -cE '^8 \[' <<<"$out")" -ge 1 ] || { echo "FAIL: no row 8"; exit 1; }
echo "README recipe: ran, $(grep -c '\[' <<<"$out") panel rows drawn"
