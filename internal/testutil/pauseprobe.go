package testutil

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// PauseProbe is a shell loop that proves a pause froze a sandbox. It counts
// its rounds and records the longest gap between two of them, read from
// /proc/uptime (centiseconds; busybox's date has no %N). A loop that was
// frozen for D shows a gap of at least D once it runs again; a loop that
// kept running shows gaps of a few tens of milliseconds. gVisor's uptime
// starts at 0 and its clocks go on while the sentry is frozen. The file holds
// "<rounds> <longest gap in centiseconds>", replaced whole by rename.
func PauseProbe(file string) string {
	// "0.08" must not become the octal 008: the fraction gets a leading 1.
	return fmt.Sprintf(`(cs() { read up _ < /proc/uptime; echo $(( ${up%%.*} * 100 + 1${up#*.} - 100 )); }
prev=$(cs); max=0; n=0
while :; do now=$(cs); g=$((now-prev)); [ $g -gt $max ] && max=$g
n=$((n+1)); echo "$n $max" > %[1]s.tmp; mv %[1]s.tmp %[1]s; prev=$now; sleep 0.02; done) >/dev/null 2>&1 &`, file)
}

// A reading taken just before a pause may be one round behind the loop, and
// the round that spans the pause is only written once the loop runs again:
// after a resume, read the probe once, then wait for a later round.

// ProbeReading is one reading of a PauseProbe file.
type ProbeReading struct {
	Rounds  int
	LongGap time.Duration
}

// ParseProbe reads what a PauseProbe wrote.
func ParseProbe(s string) (ProbeReading, error) {
	f := strings.Fields(s)
	if len(f) != 2 {
		return ProbeReading{}, fmt.Errorf("pause probe wrote %q, want \"<rounds> <gap>\"", s)
	}
	n, err1 := strconv.Atoi(f[0])
	cs, err2 := strconv.Atoi(f[1])
	if err1 != nil || err2 != nil {
		return ProbeReading{}, fmt.Errorf("pause probe wrote %q", s)
	}
	return ProbeReading{Rounds: n, LongGap: time.Duration(cs) * 10 * time.Millisecond}, nil
}
