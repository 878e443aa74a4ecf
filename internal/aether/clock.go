package aether

import (
	"log/slog"
	"net/http"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/headers"
	"github.com/opendsec/opendsec/internal/logging"
)

// clockSkew is how far the sandbox's clock may be from the node's before
// the agent steps it.
const clockSkew = 50 * time.Millisecond

// syncClock steps the sandbox's clock to the node's (headers.HostTime,
// which the edge's link sets on every request) when they differ by more
// than clockSkew, before the request runs. A VM's clock stops while it is
// paused and a restored copy's starts where its snapshot's was; a
// container's is the node's own, and its agent does not do this.
func syncClock(next http.Handler, log *slog.Logger) http.Handler {
	var mu sync.Mutex
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if v := r.Header.Get(headers.HostTime); v != "" {
			if host, err := strconv.ParseInt(v, 10, 64); err == nil {
				mu.Lock()
				if skew := time.Duration(host - time.Now().UnixNano()); skew > clockSkew || skew < -clockSkew {
					ts := unix.NsecToTimespec(host)
					if err := unix.ClockSettime(unix.CLOCK_REALTIME, &ts); err != nil {
						log.Warn("clock not set to the node's", "skew", skew, logging.Error, err)
					} else {
						log.Debug("clock stepped to the node's", "skew", skew)
					}
				}
				mu.Unlock()
			}
		}
		next.ServeHTTP(w, r)
	})
}
