# Shared by scripts/*.sh: a project-local virtual environment, installed from
# the project's own files, re-installed only when pyproject.toml changes.
KVD_VENV="${KVD_VENV:-$PWD/.venv}"

kvd_ensure_venv() {
    local extra="${1:-}"
    local python="${PYTHON:-python3}"
    local spec="."
    [ -n "$extra" ] && spec=".[$extra]"
    if [ ! -x "$KVD_VENV/bin/python" ]; then
        echo "creating $KVD_VENV" >&2
        "$python" -m venv "$KVD_VENV"
    fi
    local stamp="$KVD_VENV/.kvd-installed-$extra"
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        echo "installing kvd${extra:+[$extra]} into $KVD_VENV" >&2
        "$KVD_VENV/bin/python" -m pip install --quiet --upgrade pip
        # No bytecode compiled at install (thousands of files in torch alone):
        # Python compiles what it imports, once, on first use.
        "$KVD_VENV/bin/python" -m pip install --quiet --no-compile -e "$spec"
        touch "$stamp"
    fi
}
