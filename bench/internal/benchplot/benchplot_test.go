package benchplot

import (
	"image"
	"image/png"
	"os"
	"path/filepath"
	"testing"
)

func TestNiceStep(t *testing.T) {
	for max, want := range map[float64]float64{1000: 200, 37.5: 10, 6: 1, 0.9: 0.2, 0: 1} {
		if got := niceStep(max); got != want {
			t.Errorf("niceStep(%g) = %g, want %g", max, got, want)
		}
	}
}

// Each series is drawn in its color through its points, inside the plot.
func TestDrawPutsEachSeriesThroughItsPoints(t *testing.T) {
	c := Chart{Title: "t", XLabel: "s", YLabel: "n", Series: []Series{
		{Name: "ours", Color: Ours, Points: []Point{{0, 0}, {5, 500}, {10, 1000}}},
		{Name: "raw", Color: Raw, Points: []Point{{0, 0}, {2, 1000}}},
	}}
	img := c.Draw()
	// 0..10 s and 0..1000 map onto the plot area exactly (nice maxima).
	at := func(x, y float64) (int, int) { return left + int(x/10*plotW), top + plotH - int(y/1000*plotH) }
	for _, p := range []struct {
		x, y float64
		want any
	}{{5, 500, Ours}, {10, 1000, Ours}, {1, 500, Raw}} {
		px, py := at(p.x, p.y)
		if got := img.RGBAAt(px, py); got != p.want {
			t.Errorf("pixel of (%g, %g) at %d,%d is %v, want %v", p.x, p.y, px, py, got, p.want)
		}
	}
	path := filepath.Join(t.TempDir(), "c.png")
	if err := c.WritePNG(path); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	back, err := png.Decode(f)
	if err != nil || back.Bounds() != image.Rect(0, 0, width, height) {
		t.Fatalf("the PNG reads back as %v (%v)", back.Bounds(), err)
	}
}
