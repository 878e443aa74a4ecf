package build

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path"
	"strconv"
	"strings"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// A COPY from an archive (Instruction.Archive) copies what a client
// uploaded as a tar file, as E2B's template builds do: the archive's paths
// are relative to the client's context directory, and JSON holds
// [SOURCE, DEST] with SOURCE a path in the archive. A directory's content
// is merged into DEST (files overwritten, directories merged); a file or
// symlink becomes DEST, or goes into DEST when DEST ends in "/". Symlinks
// stay symlinks, dangling or not. A relative DEST is below WORKDIR, else
// below the current user's home. Everything copied, and every directory
// the copy makes, is owned by --chown's user[:group] (the current user by
// default); --chmod sets modes. The sandbox's own tar unpacks it, as root,
// so what tar keeps (links, modes, hard links) is kept.

// archiveSum is the sha256 of the archive's bytes, for the cache key.
func archiveSum(in Instruction) (string, error) {
	if len(in.JSON) != 2 || in.JSON[0] == "" || in.JSON[1] == "" {
		return "", errdefs.InvalidArgument("step %d: COPY from an archive needs a source and a destination", in.Line)
	}
	f, err := os.Open(in.Archive)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// copyScript does the copy in the sandbox; its inputs are in the
// environment.
const copyScript = `set -eu
u=$(mktemp -d /tmp/.dsec-copy.XXXXXX)
trap 'rm -rf "$u" "$ARCHIVE"' EXIT
tar -xf "$ARCHIVE" -C "$u"
s="$u/$SRC"
if [ ! -e "$s" ] && [ ! -L "$s" ]; then
	echo "$SRC: not in the uploaded files" >&2
	exit 1
fi
case "$DEST" in
/*) t="$DEST" ;;
*)
	base="$WORKDIR"
	if [ -z "$base" ]; then
		base=$(awk -F: -v u="$CURUSER" '$1 == u { print $6; exit }' /etc/passwd)
	fi
	t="${base:-/}/$DEST"
	;;
esac
makedir() {
	top=""
	d="$1"
	while [ ! -e "$d" ] && [ ! -L "$d" ]; do top="$d"; d=$(dirname "$d"); done
	mkdir -p "$1"
	if [ -n "$top" ]; then chown -R -h "$OWNER" "$top"; fi
}
if [ -d "$s" ] && [ ! -L "$s" ]; then
	chown -R -h "$OWNER" "$s"
	if [ -n "$MODE" ]; then chmod -R "$MODE" "$s"; fi
	makedir "$t"
	if tar --version 2>/dev/null | grep -q GNU; then
		(cd "$s" && tar -cf - .) | tar -xf - -C "$t" --keep-directory-symlink --no-overwrite-dir
	else
		cp -a "$s/." "$t/"
	fi
else
	chown -h "$OWNER" "$s"
	if [ -n "$MODE" ] && [ ! -L "$s" ]; then chmod "$MODE" "$s"; fi
	case "$t" in
	*/) makedir "$t"; t="$t$(basename "$s")" ;;
	*) makedir "$(dirname "$t")" ;;
	esac
	if [ -d "$t" ] && [ ! -L "$t" ]; then t="$t/$(basename "$s")"; fi
	rm -f "$t"
	mv "$s" "$t"
fi
`

// copyArchive writes the archive into the sandbox, unpacked from gzip if
// it is, and runs copyScript on it.
func (st *state) copyArchive(ctx context.Context, box Box, in Instruction, log io.Writer) error {
	src, dest := path.Clean(in.JSON[0]), in.JSON[1]
	if path.IsAbs(src) || src == ".." || strings.HasPrefix(src, "../") {
		return errdefs.InvalidArgument("step %d: COPY %s: the source must be a relative path inside the uploaded files", in.Line, errdefs.Clip(in.JSON[0], 80))
	}
	owner := in.Flags["chown"]
	if owner == "" {
		owner = st.cfg.User
	}
	if owner == "" {
		owner = "root"
	}
	if !strings.Contains(owner, ":") {
		owner += ":" // the user's own group
	}
	if strings.HasPrefix(owner, ":") || strings.ContainsAny(owner, " \t\n/") {
		return errdefs.InvalidArgument("step %d: COPY owner %q: want user or user:group", in.Line, errdefs.Clip(owner, 60))
	}
	mode := in.Flags["chmod"]
	if mode != "" {
		if v, err := strconv.ParseUint(mode, 8, 32); err != nil || v > 0o7777 {
			return errdefs.InvalidArgument("step %d: COPY mode %q: want octal permission bits such as 0755", in.Line, errdefs.Clip(mode, 20))
		}
	}
	r, err := plainTar(in.Archive)
	if err != nil {
		return err
	}
	defer r.Close()
	var nonce [8]byte
	rand.Read(nonce[:]) //nolint:errcheck // never fails
	tmp := "/tmp/.dsec-copy-" + hex.EncodeToString(nonce[:]) + ".tar"
	if err := box.WriteFile(ctx, tmp, r, 0o600, "root"); err != nil {
		return fmt.Errorf("step %d: COPY: upload the files into the build sandbox: %w", in.Line, err)
	}
	curUser := st.cfg.User
	if curUser == "" {
		curUser = "root"
	}
	env := []string{"ARCHIVE=" + tmp, "SRC=" + src, "DEST=" + dest, "OWNER=" + owner, "MODE=" + mode, "WORKDIR=" + st.cfg.WorkingDir, "CURUSER=" + curUser}
	var out bytes.Buffer
	code, err := box.Run(ctx, []string{"/bin/sh", "-c", copyScript}, env, "/", "root", io.MultiWriter(log, &out))
	if err != nil {
		return fmt.Errorf("step %d: COPY: %w", in.Line, err)
	}
	if code != 0 {
		return errdefs.FailedPrecondition("step %d: COPY %s %s: %s", in.Line, errdefs.Clip(src, 80), errdefs.Clip(dest, 80), errdefs.Clip(strings.TrimSpace(out.String()), 400))
	}
	return nil
}

// plainTar opens the archive, through gzip when its first bytes say so.
func plainTar(name string) (io.ReadCloser, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, err
	}
	var magic [2]byte
	n, _ := io.ReadFull(f, magic[:])
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		f.Close()
		return nil, err
	}
	if n < 2 || magic != [2]byte{0x1f, 0x8b} {
		return f, nil
	}
	z, err := gzip.NewReader(f)
	if err != nil {
		f.Close()
		return nil, errdefs.InvalidArgument("the uploaded archive: %v", err)
	}
	return struct {
		io.Reader
		io.Closer
	}{z, f}, nil
}
