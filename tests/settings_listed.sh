#!/usr/bin/env bash
# The manual's settings list (mgpu.h, "8. Settings") names every
# environment variable the library reads, and reads no variable it does
# not name. The library reads the environment with getenv("NAME") alone,
# and the launcher's variables from the `variables` arrays of mgpu/core.h.
cd "$(dirname "$0")/.."
read_by_library=$(grep -hE 'getenv\("|const variables\[' mgpu/*.h kernels/*.h |
                  grep -oE '"[A-Z][A-Z0-9_]*"' | tr -d '"' | sort -u)
# the settings section: from its title to the end of the manual
listed=$(awk '/^   8\. Settings/ { on = 1 } on && /^   =+ \*\/$/ { exit } on' mgpu.h |
         grep -oE '^     [A-Z][A-Z0-9_]*(=|,| |$)|^     [A-Z][A-Z0-9_]*(, [A-Z][A-Z0-9_]*)+' |
         grep -oE '[A-Z][A-Z0-9_]*' | sort -u)
passed=0 failed=0
if [ -z "$read_by_library" ] || [ -z "$listed" ]; then
    echo "FAIL settings_listed: found no variables (read: '$read_by_library', listed: '$listed')"
    echo "test-summary: 0 passed, 1 failed"; exit 1
fi
for name in $read_by_library; do
    if grep -qx "$name" <<< "$listed"; then passed=$((passed + 1))
    else echo "FAIL settings_listed: the library reads $name, which the manual's settings list does not name"; failed=$((failed + 1)); fi
done
for name in $listed; do
    if ! grep -qx "$name" <<< "$read_by_library"; then
        echo "FAIL settings_listed: the manual's settings list names $name, which the library does not read"; failed=$((failed + 1))
    fi
done
[ "$failed" -eq 0 ] && echo "ok   settings_listed: $(echo $read_by_library | wc -w) variables, each in the manual's list"
echo "test-summary: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
