// Package progress draws a progress bar for long work (image builds,
// imports, uploads) on a terminal, and prints occasional plain lines when
// the output is a file or pipe.
package progress

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"
)

// Bar reports progress of stages to w.
type Bar struct {
	w   io.Writer
	tty bool

	mu        sync.Mutex
	stage     string    // guarded by mu
	lastDraw  time.Time // guarded by mu
	lastPct   int       // guarded by mu
	lastWidth int       // guarded by mu
	started   time.Time // guarded by mu
}

// New returns a bar writing to w (a terminal gets a redrawn bar).
func New(w io.Writer) *Bar {
	tty := false
	if f, ok := w.(*os.File); ok {
		if fi, err := f.Stat(); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
			tty = true
		}
	}
	return &Bar{w: w, tty: tty, lastPct: -1, started: time.Now()}
}

// Update reports done of total (total 0: unknown) for stage.
func (b *Bar) Update(stage string, done, total int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	if stage != b.stage {
		if b.tty && b.stage != "" {
			fmt.Fprintln(b.w)
			b.lastWidth = 0
		}
		b.stage, b.lastPct, b.started = stage, -1, now
	}
	pct := -1
	if total > 0 {
		pct = int(done * 100 / total)
	}
	if b.tty {
		if now.Sub(b.lastDraw) < 100*time.Millisecond && pct == b.lastPct {
			return
		}
		line := render(stage, done, total, now.Sub(b.started))
		pad := ""
		if n := b.lastWidth - len(line); n > 0 {
			pad = strings.Repeat(" ", n)
		}
		fmt.Fprintf(b.w, "\r%s%s", line, pad)
		b.lastWidth = len(line)
	} else {
		// Plain output: a line per 25% or every 10 s.
		if (pct < 0 || pct/25 == b.lastPct/25) && now.Sub(b.lastDraw) < 10*time.Second {
			return
		}
		fmt.Fprintln(b.w, render(stage, done, total, now.Sub(b.started)))
	}
	b.lastDraw, b.lastPct = now, pct
}

// Done ends the current line.
func (b *Bar) Done(msg string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.tty && b.stage != "" {
		fmt.Fprintln(b.w)
	}
	if msg != "" {
		fmt.Fprintln(b.w, msg)
	}
	b.stage = ""
}

func render(stage string, done, total int64, elapsed time.Duration) string {
	secs := elapsed.Round(time.Second)
	if total <= 0 {
		if done > 0 {
			return fmt.Sprintf("%s %s (%s)", stage, human(done), secs)
		}
		return fmt.Sprintf("%s (%s)", stage, secs)
	}
	const width = 30
	pct := min(done*100/total, 100)
	fill := int(pct * width / 100)
	amount := fmt.Sprintf("%s/%s", human(done), human(total))
	if total < 64<<10 {
		amount = fmt.Sprintf("%d/%d", done, total) // steps, or a small byte count
	}
	return fmt.Sprintf("%s [%s%s] %3d%% %s (%s)", stage, strings.Repeat("=", fill), strings.Repeat(" ", width-fill), pct, amount, secs)
}

func human(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1fGiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1fMiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1fKiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%dB", n)
}
