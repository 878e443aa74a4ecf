// Package benchstat holds what the benchmarks under bench/ share:
// percentiles, durations in milliseconds and the client settings dsec up
// writes.
package benchstat

import (
	"fmt"
	"os"
	"sort"
	"strings"
	"time"
)

// Pct is the p-th percentile of d (nearest rank).
func Pct(d []time.Duration, p int) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	i := (len(s)*p+99)/100 - 1
	return s[max(0, min(i, len(s)-1))]
}

// Ms prints d in milliseconds with the given number of decimals.
func Ms(d time.Duration, decimals int) string {
	return fmt.Sprintf("%.*fms", decimals, float64(d.Microseconds())/1000)
}

// EnvValue reads one variable from a client.env file.
func EnvValue(path, name string) string {
	data, _ := os.ReadFile(path)
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "export "+name+"="); ok {
			return v
		}
	}
	return ""
}
