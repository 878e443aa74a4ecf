package rpcproxy

import (
	"math"
	"net/http"
	"strconv"
	"time"
)

// CallTimeout is the deadline a client gave its call, from Connect's
// Connect-Timeout-Ms header or gRPC's Grpc-Timeout ("5S", "100m", ...), so
// a proxy can apply it itself instead of trusting the hop behind it to.
func CallTimeout(h http.Header) (time.Duration, bool) {
	if v := h.Get("Connect-Timeout-Ms"); v != "" {
		ms, err := strconv.ParseInt(v, 10, 64)
		if err != nil || ms <= 0 || len(v) > 10 {
			return 0, false
		}
		return time.Duration(ms) * time.Millisecond, true
	}
	v := h.Get("Grpc-Timeout")
	if len(v) < 2 || len(v) > 9 {
		return 0, false
	}
	n, err := strconv.ParseInt(v[:len(v)-1], 10, 64)
	if err != nil || n <= 0 {
		return 0, false
	}
	unit := map[byte]time.Duration{'H': time.Hour, 'M': time.Minute, 'S': time.Second, 'm': time.Millisecond, 'u': time.Microsecond, 'n': time.Nanosecond}[v[len(v)-1]]
	if unit == 0 {
		return 0, false
	}
	// Eight digits of hours (gRPC allows them) overflow a Duration: such a
	// deadline is as good as none, and stays positive.
	if n > math.MaxInt64/int64(unit) {
		return time.Duration(math.MaxInt64), true
	}
	return time.Duration(n) * unit, true
}
