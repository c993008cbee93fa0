#!/usr/bin/env bash
# The tests and benchmarks reach the library's internals (the mgpu__ and
# MGPU__ names that mgpu/ defines) through one list, the testing
# interface mgpu/testing.h, and it lists nothing else. Checked:
#   named:   every internal a test or benchmark uses in its code (its
#            comments aside) is declared or named in mgpu/testing.h;
#   used:    every name mgpu/testing.h declares, or names in a comment,
#            is used by a test or benchmark;
#   defined: each is defined in the part whose group it sits in (the
#            group's heading, "---- mgpu/NAME.h: why"), and the groups
#            follow mgpu.h's include order.
# (The compiler checks the declarations against the definitions.) The
# kernels' own names (kernels/) are not internals here: the kernel files
# are their own interface. Neither is the emulator (tests/cuda_emu.h,
# tests/cuda_emu_runtime.h), which stands in for CUDA, not for mgpu.
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Reads C as this project writes it and prints, per file, one line for
# each mgpu__/MGPU__ name in it:
#   def NAME FILE LINE    declared at file scope: a function, a variable,
#                         a type or struct tag, an enumerator, a macro
#   use NAME FILE LINE    in code (comments and strings aside)
#   note NAME FILE LINE   in a comment
#   part PART FILE LINE   a comment that opens "---- mgpu/NAME.h"
#   unbalanced - FILE -   where the file's braces or parentheses do not
#                         balance (this reader lost its way)
# A declaration's name is the identifier before its parameters' "(", or
# before "[", "=", ";" or "," at file scope; a struct's tag the one
# before its "{"; an enumerator the first identifier of each item of an
# enum's body. mgpu.h is read from its implementation section on (what
# comes before is the public API).
cat > "$work/names.awk" <<'EOF'
function internal(t) { return t ~ /^(mgpu__|MGPU__)[A-Za-z0-9_]+$/ }
function out(kind, t) { if (internal(t)) print kind, t, FILENAME, FNR }
function ident(t) { return t ~ /^[A-Za-z_][A-Za-z0-9_]*$/ }
function top() { return sp == 0 ? "file" : stack[sp] }
# one token of code; p1, p2, p3: the tokens before it
function token(t,    kind) {
    if (t == "{") {
        if (top() == "enum") kind = "block"
        else if (p1 == "\"\"" && p2 == "extern") kind = "file"  # extern "C" { ... }
        else if (top() == "file" && paren == 0 && !init && enum_seen) kind = "enum"
        else kind = (p1 == ")") ? "body" : "block"
        if (kind != "body" && kind != "file" && top() == "file" && paren == 0 && !init && ident(p1)) out("def", p1)
        stack[++sp] = kind
        if (kind == "enum") expect = 1
    } else if (t == "}") {
        if (sp > 0) sp--
        if (stack[sp + 1] == "body" && top() == "file") { init = 0; enum_seen = 0; declarator = 0 }
    } else if (top() == "enum") {
        if (expect && ident(t)) out("def", t)
        expect = 0
        if (t == "(") eparen++
        else if (t == ")") eparen--
        else if (t == "," && eparen == 0) expect = 1
    } else if (top() == "file") {
        if (t == "(") {
            # a function's name; what follows its parameters (an
            # attribute, MGPU__PRINTF(2, 3)) is not one
            if (paren == 0 && !init && !declarator && ident(p1) && p1 !~ /^(__attribute__|_?[Ss]tatic_assert)$/) {
                out("def", p1); declarator = 1
            }
            paren++
        } else if (t == ")") {
            if (paren == 1 && p2 == "*" && p3 == "(" && ident(p1)) out("def", p1)  # (*pointer)(...)
            paren--
        } else if (paren == 0) {
            if (!init && (t == "[" || t == "=" || t == ";" || t == ",") && ident(p1)) out("def", p1)
            if (t == "=") init = 1
            else if (t == ",") { init = 0; declarator = 0 }
            else if (t == ";") { init = 0; enum_seen = 0; declarator = 0 }
            else if (t == "enum") enum_seen = 1
        }
    }
    p3 = p2; p2 = p1; p1 = t
}
# the names in a comment's text (from its "/*" where it opens here)
function notes(text,    part) {
    if (text ~ /^\/\*[ ]*-+[ ]+mgpu\/[a-z_]+\.h/) {
        part = text; sub(/^\/\*[ ]*-+[ ]+/, "", part); sub(/\.h.*/, ".h", part)
        print "part", part, FILENAME, FNR
    }
    while (match(text, /(mgpu__|MGPU__)[A-Za-z0-9_]+/)) {
        out("note", substr(text, RSTART, RLENGTH)); text = substr(text, RSTART + RLENGTH)
    }
}
function finish() { if (sp != 0 || paren != 0 || incomment) print "unbalanced", "-", file, "-" }
FNR == 1 {
    if (NR > 1) finish()
    file = FILENAME; sp = 0; paren = 0; eparen = 0; init = 0; enum_seen = 0; declarator = 0; expect = 0
    incomment = 0; directive = 0; p1 = p2 = p3 = ""
    api = FILENAME ~ /(^|\/)mgpu\.h$/
}
api { if ($0 ~ /^#ifdef MGPU_IMPLEMENTATION/) api = 0; else next }
{
    line = $0
    # a preprocessor directive: its names are uses, a #define's is a definition
    if (!incomment && (directive || line ~ /^[ \t]*#/)) {
        if (!directive && line ~ /^[ \t]*#[ \t]*define[ \t]/) {
            d = line; sub(/^[ \t]*#[ \t]*define[ \t]+/, "", d); match(d, /^[A-Za-z0-9_]+/); out("def", substr(d, 1, RLENGTH))
        }
        directive = line ~ /\\$/
        if (match(line, /\/[*\/]/)) {
            end = RSTART; rest = substr(line, end); line = substr(line, 1, end - 1); notes(rest)
            if (rest ~ /^\/\*/ && rest !~ /\*\//) { incomment = 1; directive = 0 }  # goes on below
        }
        while (match(line, /[A-Za-z_][A-Za-z0-9_]*/)) { out("use", substr(line, RSTART, RLENGTH)); line = substr(line, RSTART + RLENGTH) }
        next
    }
    while (line != "") {
        if (incomment) {
            if (match(line, /\*\//)) { end = RSTART + 1; notes(opened substr(line, 1, end)); line = substr(line, end + 1); incomment = 0 }
            else { notes(opened line); line = "" }
            opened = ""
        } else if (match(line, /^[ \t]+/)) line = substr(line, RLENGTH + 1)
        else if (substr(line, 1, 2) == "//") { notes(line); line = "" }
        else if (substr(line, 1, 2) == "/*") { incomment = 1; opened = "/*"; line = substr(line, 3) }
        else if (match(line, /^"([^"\\]|\\.)*"/) || match(line, /^'([^'\\]|\\.)*'/)) { token("\"\""); line = substr(line, RLENGTH + 1) }
        else if (match(line, /^[A-Za-z_][A-Za-z0-9_]*/)) { t = substr(line, 1, RLENGTH); out("use", t); token(t); line = substr(line, RLENGTH + 1) }
        else if (match(line, /^[0-9][A-Za-z0-9_.]*/)) { token("0"); line = substr(line, RLENGTH + 1) }
        else { token(substr(line, 1, 1)); line = substr(line, 2) }
    }
}
END { if (NR > 0) finish() }
EOF

passed=0 failed=0
fail() { echo "FAIL internals_listed: $*"; failed=$((failed + 1)); }
interface=mgpu/testing.h
parts=$(sed -n 's/^#include "\(mgpu\/[a-z_]*\.h\)".*/\1/p' mgpu.h)
mapfile -t users < <(find tests bench \( -name '*.c' -o -name '*.h' \) \
                       ! -path tests/cuda_emu.h ! -path tests/cuda_emu_runtime.h | sort)
if [ ! -f "$interface" ] || [ "${#users[@]}" -eq 0 ]; then
    fail "no $interface, or no tests and benchmarks to read"
    echo "test-summary: 0 passed, 1 failed"; exit 1
fi
# what the parts define (NAME PART), and what the tests and benchmarks use (NAME FILE)
awk -f "$work/names.awk" $(grep -vx "$interface" <<< "$parts") mgpu.h > "$work/parts"
awk '$1 == "def" { print $2, $3 }' "$work/parts" | sort -u > "$work/defined"
awk -f "$work/names.awk" "${users[@]}" | awk '$1 == "use" { print $2, $3 }' | sort -u > "$work/used"
# what the interface names (NAME PART: the group it sits in), and its groups in order
awk -f "$work/names.awk" "$interface" > "$work/interface"
awk '$1 == "part" { part = $2 } $1 == "def" || $1 == "note" { print $2, (part ? part : "-") }' \
    "$work/interface" | sort -u > "$work/listed"
awk '$1 == "part" { print $2 }' "$work/interface" > "$work/groups"
while read -r _ _ file _; do fail "cannot read $file (its braces or comments do not balance)"; done \
    < <(grep '^unbalanced' "$work/parts" "$work/interface" | cut -d: -f2-)
if [ ! -s "$work/defined" ] || [ ! -s "$work/listed" ]; then
    fail "found no internals (defined: $(wc -l < "$work/defined"), listed: $(wc -l < "$work/listed"))"
    echo "test-summary: $passed passed, $failed failed"; exit 1
fi

# named: every internal the tests and benchmarks use
before=$failed
internals_used=$(awk 'NR == FNR { part[$1] = $2; next } ($1 in part) { print $1 }' \
                 "$work/defined" "$work/used" | sort -u)
for name in $internals_used; do
    if awk -v n="$name" '$1 == n { found = 1 } END { exit !found }' "$work/listed"; then
        passed=$((passed + 1))
    else
        users_of=$(awk -v n="$name" '$1 == n { print $2 }' "$work/used" | tr '\n' ' ')
        fail "${users_of% }: uses $name ($(awk -v n="$name" '$1 == n { print $2; exit }' "$work/defined")), which $interface does not name"
    fi
done
[ "$failed" -eq "$before" ] && echo "ok   internals_listed: named: the $(wc -w <<< "$internals_used") internals that tests and benchmarks use"

# used and defined: everything the interface names
before=$failed
while read -r name part; do
    if [ "$part" = - ]; then fail "$interface names $name before its first group's heading"; continue; fi
    ok=1
    if ! grep -q "^$name " "$work/used"; then
        fail "$interface names $name ($part), which no test or benchmark uses"; ok=0
    fi
    if ! grep -qx "$name $part" "$work/defined"; then
        where=$(awk -v n="$name" '$1 == n { print $2 }' "$work/defined" | tr '\n' ' ')
        where=${where% }
        fail "$interface names $name under $part, which does not define it (${where:+defined in }${where:-no part of mgpu/ defines it})"; ok=0
    fi
    [ "$ok" -eq 1 ] && passed=$((passed + 1))
done < "$work/listed"
[ "$failed" -eq "$before" ] && echo "ok   internals_listed: used and defined: the $(wc -l < "$work/listed") names of $interface"

# the groups: each a part, once, in mgpu.h's order
if [ "$(cat "$work/groups")" = "$(grep -xF -f "$work/groups" <<< "$parts")" ] &&
   [ "$(sort -u "$work/groups" | wc -l)" -eq "$(wc -l < "$work/groups")" ]; then
    echo "ok   internals_listed: $(wc -l < "$work/groups") groups, in mgpu.h's include order"; passed=$((passed + 1))
else
    fail "$interface's groups ($(tr '\n' ' ' < "$work/groups")) are not mgpu.h's parts, once each, in its include order"
fi
echo "test-summary: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
