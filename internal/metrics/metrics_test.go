package metrics

import (
	"io"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/version"
	"github.com/prometheus/client_golang/prometheus"
)

// A flood of scrapes gathers the metrics at most once a second: scrapes
// within it get the same text, a later one sees what changed.
func TestHandlerRendersAtMostOnceASecond(t *testing.T) {
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "opendsec_test_total", Help: "x"})
	reg.MustRegister(c)
	h := Handler(reg)
	get := func() string {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest("GET", "/metrics", nil))
		if w.Code != 200 || !strings.HasPrefix(w.Header().Get("Content-Type"), "text/plain") {
			t.Fatalf("scrape: %d %q", w.Code, w.Header().Get("Content-Type"))
		}
		b, _ := io.ReadAll(w.Body)
		return string(b)
	}
	first := get()
	c.Inc()
	if got := get(); got != first || !strings.Contains(got, "opendsec_test_total 0") {
		t.Fatalf("a scrape within the second rendered again: %q", got)
	}
	time.Sleep(renderEvery + 50*time.Millisecond)
	if got := get(); !strings.Contains(got, "opendsec_test_total 1") {
		t.Fatalf("a scrape after the second: %q", got)
	}
}

// Every process's registry says which build it runs.
func TestRegistryCarriesTheBuildVersion(t *testing.T) {
	old := version.Version
	version.Version = "v9.9.9-test"
	defer func() { version.Version = old }()
	w := httptest.NewRecorder()
	Handler(NewRegistry()).ServeHTTP(w, httptest.NewRequest("GET", "/metrics", nil))
	if want := `opendsec_build_info{version="v9.9.9-test"} 1`; !strings.Contains(w.Body.String(), want) {
		t.Fatalf("no %s in:\n%.2000s", want, w.Body.String())
	}
}
