# shellcheck shell=bash
# Sourced by scripts/try, scripts/test and .ci/run: what a script needs, installed with apt-get
# when it is missing, or, where there is no apt-get (or no root and no sudo), named exactly
# before the script exits 1, so that it never runs half.
#
#   need PACKAGES WHAT CHECK [ARGS...]   # CHECK fails: PACKAGES (Debian's names) are needed
#   install_needs NAME                   # installs them all, or says what to install and exits
#
# An empty PACKAGES is something apt-get cannot install (Rust's cargo): it is only named.

needs_packages=()
needs_missing=()
needs_unknown=no

need() {
    local packages=$1 what=$2
    shift 2
    if "$@" >/dev/null; then
        return 0
    fi
    if [ -n "$packages" ]; then
        needs_missing+=("$what (Debian/Ubuntu: apt-get install $packages)")
        # shellcheck disable=SC2206 # several packages, split on spaces
        needs_packages+=($packages)
    else
        needs_missing+=("$what")
        needs_unknown=yes
    fi
}

# Whether every program is on PATH or in /usr/sbin (where Debian puts daemons).
on_path() {
    local program
    for program in "$@"; do
        command -v "$program" >/dev/null || [ -x "/usr/sbin/$program" ] || return 1
    done
}

# PostgreSQL's server binaries, found where the tests' harness looks for them
# (tests/integration/harness/cluster.rs): PGLEADER_TEST_PG_BINDIR, pg_config's, then Debian's
# /usr/lib/postgresql/MAJOR/bin, the newest first. Prints the directory.
pg_bindir() {
    local dir
    for dir in "${PGLEADER_TEST_PG_BINDIR:-}" "$(pg_config --bindir 2>/dev/null)" \
        $(printf '%s\n' /usr/lib/postgresql/*/bin | sort -t/ -k5 -rn); do
        if [ -n "$dir" ] && [ -x "$dir/initdb" ] && [ -x "$dir/postgres" ] && [ -x "$dir/pg_ctl" ]; then
            echo "$dir"
            return 0
        fi
    done
    return 1
}

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

install_needs() {
    local name=$1 line
    [ ${#needs_missing[@]} -eq 0 ] && return 0
    if [ "$needs_unknown" = no ] && command -v apt-get >/dev/null &&
        { [ "$(id -u)" -eq 0 ] || command -v sudo >/dev/null; }; then
        echo "$name: installing ${needs_packages[*]}"
        as_root apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends "${needs_packages[@]}"
        needs_packages=()
        needs_missing=()
        return 0
    fi
    {
        echo "$name: install these first, then run it again:"
        for line in "${needs_missing[@]}"; do
            echo "  - $line"
        done
    } >&2
    exit 1
}
