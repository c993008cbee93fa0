#!/usr/bin/env bash
# data/fetch.sh (run by `make data`): fills data/fashion-mnist/ with the four
# Fashion-MNIST files.
#
# Where they come from, first that works:
#   1. a local copy: $MGPU_DATA, else ../shared/fashion-mnist beside the
#      checkout (the files are copied, so the checkout can travel alone);
#   2. the data set's official mirror (needs curl or wget).
# Each file is then checked against the sha256 of its UNCOMPRESSED bytes,
# as published with the data set; a file that does not match is removed and
# the script fails. Files already in place and correct are kept, so running
# it again does nothing.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/data/fashion-mnist"
mirror="http://fashion-mnist.s3-website.eu-central-1.amazonaws.com"

# name and sha256 of the uncompressed file
files=(
    "train-images-idx3-ubyte c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888"
    "train-labels-idx1-ubyte bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9"
    "t10k-images-idx3-ubyte 5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b"
    "t10k-labels-idx1-ubyte 0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34"
)

fail() { echo "data/fetch.sh: error: $*" >&2; exit 1; }

sha256_of() {
    if command -v sha256sum >/dev/null; then sha256sum | cut -d' ' -f1
    else shasum -a 256 | cut -d' ' -f1; fi
}

# The sha256 of a .gz file's uncompressed bytes ("corrupt" if gunzip fails).
uncompressed_sha() {
    local sum
    sum=$(gunzip -c "$1" 2>/dev/null | sha256_of) || sum=corrupt
    echo "$sum"
}

# The local copy, if any: a folder holding the four .gz files.
local_copy=""
for dir in "${MGPU_DATA:-}" "$root/../shared/fashion-mnist"; do
    [ -n "$dir" ] && [ -d "$dir" ] || continue
    [ "$(cd "$dir" && pwd)" = "$dest" ] && continue   # that is where we write
    if [ -f "$dir/train-images-idx3-ubyte.gz" ]; then local_copy=$(cd "$dir" && pwd); break; fi
done

mkdir -p "$dest"
for entry in "${files[@]}"; do
    name=${entry%% *}
    want=${entry##* }
    file="$dest/$name.gz"
    if [ -f "$file" ] && [ "$(uncompressed_sha "$file")" = "$want" ]; then
        echo "ok      $name.gz (already there)"
        continue
    fi
    if [ -n "$local_copy" ] && [ -f "$local_copy/$name.gz" ]; then
        echo "copying $name.gz from $local_copy"
        cp "$local_copy/$name.gz" "$file.part"
    else
        echo "fetching $mirror/$name.gz"
        if command -v curl >/dev/null; then
            curl -fsSL --retry 3 -o "$file.part" "$mirror/$name.gz" ||
                { rm -f "$file.part"; fail "could not download $mirror/$name.gz (offline? set MGPU_DATA to a folder holding the four .gz files)"; }
        elif command -v wget >/dev/null; then
            wget -q -O "$file.part" "$mirror/$name.gz" ||
                { rm -f "$file.part"; fail "could not download $mirror/$name.gz (offline? set MGPU_DATA to a folder holding the four .gz files)"; }
        else
            fail "no local copy of Fashion-MNIST (set MGPU_DATA to a folder holding it) and neither curl nor wget to download it"
        fi
    fi
    got=$(uncompressed_sha "$file.part")
    if [ "$got" != "$want" ]; then
        rm -f "$file.part"
        fail "$name.gz: sha256 of the uncompressed data is $got, expected $want (a damaged or different file; removed)"
    fi
    mv -f "$file.part" "$file"
    echo "ok      $name.gz"
done
echo "Fashion-MNIST is in $dest"
