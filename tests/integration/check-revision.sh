#!/usr/bin/env bash
# check-revision.sh - `epd --version` names the source revision the binary was built from: the
# checkout's HEAD, with or without "-dirty" (cmake/git_rev.cmake takes it at every build, so a
# commit after the configure step must show). Exit 77 (skipped) where the source is not a git
# checkout or git is missing.
#
# Usage: check-revision.sh EPD_BINARY SOURCE_DIR
set -u
epd=${1:?usage: check-revision.sh EPD_BINARY SOURCE_DIR}
src=${2:?usage: check-revision.sh EPD_BINARY SOURCE_DIR}

head=$(git -C "$src" rev-parse --short=12 HEAD 2>/dev/null) || {
        echo "skip: $src is not a git checkout"
        exit 77
}
out=$("$epd" --version) || {
        echo "FAILED: $epd --version exited with status $?"
        exit 1
}
case "$out" in
*"$head"*)
        echo "ok: '$out' names HEAD $head"
        exit 0
        ;;
esac
echo "FAILED: '$out' does not name HEAD $head (a binary built before the last commit?)"
exit 1
