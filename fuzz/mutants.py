#!/usr/bin/env python3
"""Seeded mutants of a committed fuzz corpus, the same bytes on every machine.

    python3 fuzz/mutants.py CORPUS_DIR OUT_DIR COUNT MAX_LEN [SEED]

Writes COUNT inputs into OUT_DIR (emptied first): each one a corpus file
changed by one to five of libFuzzer's own kinds of step (flip a bit, set a
byte, insert or erase bytes, copy a part, cross over with another corpus
file, write an interesting integer, change a decimal number), at most
MAX_LEN bytes.  CI runs the fuzz targets over these with -runs=0: unlike a
coverage-guided run, whose next input depends on which code the last one
reached (and so on the CPU the library dispatched for), these inputs depend
on nothing but the corpus and SEED, so the stage passes or fails the same
way on every machine.  The long, coverage-guided campaigns are
scripts/fuzz.sh's.
"""
import os
import random
import shutil
import struct
import sys

INTERESTING = [0, 1, 2, 7, 8, 16, 32, 64, 100, 127, 128, 255, 256, 1024,
               4096, 32767, 32768, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1,
               2**63 - 1, 2**64 - 1]


def mutate_once(rng, data, corpus, max_len):
    """One libFuzzer-like step on the bytearray data (returns a new one)."""
    op = rng.randrange(9)
    n = len(data)
    if op == 0 and n:                                  # flip a bit
        i = rng.randrange(n)
        data[i] ^= 1 << rng.randrange(8)
    elif op == 1 and n:                                # set a byte
        data[rng.randrange(n)] = rng.randrange(256)
    elif op == 2:                                      # insert bytes
        i = rng.randrange(n + 1)
        k = rng.randrange(1, 9)
        fill = (bytes([rng.randrange(256)]) * k if rng.randrange(2)
                else bytes(rng.randrange(256) for _ in range(k)))
        data[i:i] = fill
    elif op == 3 and n > 1:                            # erase bytes
        i = rng.randrange(n)
        del data[i:i + rng.randrange(1, min(16, n - i) + 1)]
    elif op == 4 and n > 1:                            # copy a part
        i, j = rng.randrange(n), rng.randrange(n)
        k = rng.randrange(1, min(16, n - i) + 1)
        part = data[i:i + k]
        if rng.randrange(2):
            data[j:j + k] = part
        else:
            data[j:j] = part
    elif op == 5:                                      # cross over
        other = rng.choice(corpus)
        if other:
            i = rng.randrange(len(other))
            k = rng.randrange(1, len(other) - i + 1)
            j = rng.randrange(n + 1)
            data[j:] = other[i:i + k] + data[j:]
    elif op == 6 and n >= 8:                           # interesting integer
        v = rng.choice(INTERESTING)
        if rng.randrange(2):
            v = -v
        width = rng.choice([1, 2, 4, 8])
        i = rng.randrange(n - width + 1)
        fmt = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[width]
        if rng.randrange(2):
            fmt = ">" + fmt[1:]
        data[i:i + width] = struct.pack(fmt, v % (1 << (8 * width)))
    elif op == 7:                                      # a decimal number
        digits = [i for i, c in enumerate(data) if 48 <= c <= 57]
        if digits:
            i = rng.choice(digits)
            j = i
            while j < n and 48 <= data[j] <= 57:
                j += 1
            data[i:j] = str(rng.choice(INTERESTING + [rng.randrange(10**6)])
                            ).encode()
    elif op == 8 and n > 1:                            # shuffle a few
        i = rng.randrange(n - 1)
        k = min(rng.randrange(2, 9), n - i)
        part = list(data[i:i + k])
        rng.shuffle(part)
        data[i:i + k] = bytes(part)
    return data[:max_len]


def main(argv):
    if len(argv) not in (5, 6):
        sys.exit(__doc__)
    corpus_dir, out_dir = argv[1], argv[2]
    count, max_len = int(argv[3]), int(argv[4])
    seed = int(argv[5]) if len(argv) == 6 else 1
    names = sorted(os.listdir(corpus_dir))
    corpus = []
    for name in names:
        with open(os.path.join(corpus_dir, name), "rb") as f:
            corpus.append(f.read()[:max_len])
    if not corpus:
        sys.exit(f"mutants.py: {corpus_dir} holds no inputs")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    rng = random.Random(seed)
    for k in range(count):
        data = bytearray(corpus[k % len(corpus)])
        for _ in range(rng.randrange(1, 6)):
            data = mutate_once(rng, data, corpus, max_len)
        with open(os.path.join(out_dir, f"m{k:07d}"), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main(sys.argv)
