// Package benchplot draws a benchmark's series as lines on a PNG: what a
// table's single figure hides (a burst that stalls, then catches up), one
// look shows.
package benchplot

import (
	"fmt"
	"image"
	"image/color"
	"image/draw"
	"image/png"
	"math"
	"os"

	"golang.org/x/image/font"
	"golang.org/x/image/font/basicfont"
	"golang.org/x/image/math/fixed"
)

// Point is one (x, y) of a series.
type Point struct{ X, Y float64 }

// Series is one line: its name in the legend, its color, its points in
// order of X.
type Series struct {
	Name   string
	Color  color.RGBA
	Points []Point
}

// Chart is a line chart of series against one pair of axes from 0.
type Chart struct {
	Title, XLabel, YLabel string
	Series                []Series
}

// Colors for a chart's first series: ours, then the raw tool's.
var (
	Ours = color.RGBA{0x1f, 0x77, 0xb4, 0xff}
	Raw  = color.RGBA{0xd6, 0x27, 0x28, 0xff}
)

const (
	width, height            = 800, 500
	left, right, top, bottom = 70, 20, 40, 50
	plotW, plotH             = width - left - right, height - top - bottom
	ticksWanted              = 6
)

// WritePNG draws c to the file at path.
func (c Chart) WritePNG(path string) error {
	img := c.Draw()
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := png.Encode(f, img); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// Draw draws c.
func (c Chart) Draw() *image.RGBA {
	img := image.NewRGBA(image.Rect(0, 0, width, height))
	draw.Draw(img, img.Bounds(), image.White, image.Point{}, draw.Src)
	maxX, maxY := 0.0, 0.0
	for _, s := range c.Series {
		for _, p := range s.Points {
			maxX, maxY = math.Max(maxX, p.X), math.Max(maxY, p.Y)
		}
	}
	xStep, yStep := niceStep(maxX), niceStep(maxY)
	maxX, maxY = math.Ceil(maxX/xStep)*xStep, math.Ceil(maxY/yStep)*yStep
	toPx := func(p Point) (int, int) {
		return left + int(p.X/maxX*plotW), top + plotH - int(p.Y/maxY*plotH)
	}
	grey, black := color.RGBA{0xdd, 0xdd, 0xdd, 0xff}, color.RGBA{0, 0, 0, 0xff}
	for x := 0.0; x <= maxX+xStep/2; x += xStep {
		px, _ := toPx(Point{X: x})
		line(img, px, top, px, top+plotH, grey)
		label := format(x)
		text(img, px-len(label)*7/2, top+plotH+16, label, black)
	}
	for y := 0.0; y <= maxY+yStep/2; y += yStep {
		_, py := toPx(Point{Y: y})
		line(img, left, py, left+plotW, py, grey)
		label := format(y)
		text(img, left-8-len(label)*7, py+4, label, black)
	}
	line(img, left, top, left, top+plotH, black)
	line(img, left, top+plotH, left+plotW, top+plotH, black)
	text(img, left, 20, c.Title, black)
	text(img, left+plotW/2-len(c.XLabel)*7/2, height-12, c.XLabel, black)
	text(img, 4, top-8, c.YLabel, black)
	for i, s := range c.Series {
		for j := 1; j < len(s.Points); j++ {
			x0, y0 := toPx(s.Points[j-1])
			x1, y1 := toPx(s.Points[j])
			line(img, x0, y0, x1, y1, s.Color)
			line(img, x0, y0-1, x1, y1-1, s.Color)
		}
		ly := top + 16 + i*18
		draw.Draw(img, image.Rect(left+12, ly-9, left+30, ly+1), image.NewUniform(s.Color), image.Point{}, draw.Src)
		text(img, left+36, ly, s.Name, black)
	}
	return img
}

// niceStep is a tick step of 1, 2 or 5 times a power of ten that cuts
// 0..max into about ticksWanted pieces.
func niceStep(max float64) float64 {
	if max <= 0 {
		return 1
	}
	raw := max / ticksWanted
	pow := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*pow >= raw {
			return m * pow
		}
	}
	return 10 * pow
}

// format prints a tick's value without needless decimals.
func format(v float64) string {
	if v == math.Trunc(v) {
		return fmt.Sprintf("%.0f", v)
	}
	return fmt.Sprintf("%.2g", v)
}

// line draws from (x0, y0) to (x1, y1) (Bresenham).
func line(img *image.RGBA, x0, y0, x1, y1 int, c color.RGBA) {
	dx, dy := abs(x1-x0), -abs(y1-y0)
	sx, sy := sign(x1-x0), sign(y1-y0)
	e := dx + dy
	for {
		img.SetRGBA(x0, y0, c)
		if x0 == x1 && y0 == y1 {
			return
		}
		e2 := 2 * e
		if e2 >= dy {
			e += dy
			x0 += sx
		}
		if e2 <= dx {
			e += dx
			y0 += sy
		}
	}
}

// text writes s with its baseline at y.
func text(img *image.RGBA, x, y int, s string, c color.RGBA) {
	d := font.Drawer{Dst: img, Src: image.NewUniform(c), Face: basicfont.Face7x13, Dot: fixed.P(x, y)}
	d.DrawString(s)
}

func abs(v int) int {
	if v < 0 {
		return -v
	}
	return v
}

func sign(v int) int {
	switch {
	case v < 0:
		return -1
	case v > 0:
		return 1
	}
	return 0
}
