package main

import (
	"os"
	"path/filepath"
	"testing"
)

// The page Python writes (tests/golden/worker-status.page, checked byte for byte by
// tests/ipc/test_status_page.py) reads here as the same fill, and refuses with the same words.
func TestGoldenStatusPage(t *testing.T) {
	dir := t.TempDir()
	golden, err := os.ReadFile(filepath.Join("..", "..", "tests", "golden", "worker-status.page"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, statusPageName), golden, 0o600); err != nil {
		t.Fatal(err)
	}
	page := newStatusPage(filepath.Join(dir, "worker.sock"))
	fill, ok := page.fill()
	if !ok || fill != (queueFill{pending: 5, pendingBytes: 123456, maxQueueSize: 64, maxQueueBytes: 3 << 20}) {
		t.Fatalf("fill = %+v, %v", fill, ok)
	}
	if got := page.refusal(3<<20-123456+1, 0, 0); got != "queue full: 123456 bytes waiting, this request adds 3022273 (max_queue_bytes=3145728); retry with backoff" {
		t.Fatalf("refusal by bytes = %q", got)
	}
	if got := page.refusal(1024, 0, 0); got != "" {
		t.Fatalf("refusal with room = %q", got)
	}
	full := queueFill{pending: 64, maxQueueSize: 64, maxQueueBytes: 1 << 20}
	if got := full.refusal(1, 0, 0); got != "queue full: 64 requests waiting (max_queue_size=64); retry with backoff" {
		t.Fatalf("refusal by count = %q", got)
	}
	if got := (queueFill{maxQueueSize: 4, maxQueueBytes: 10}).refusal(1<<30, 0, 0); got != "" {
		t.Fatalf("an empty queue refused: %q", got)
	}
	// What this front end sent that the worker has not read yet reaches the queue first.
	room := queueFill{pending: 60, pendingBytes: 600, maxQueueSize: 64, maxQueueBytes: 1000}
	if got := room.refusal(1, 4, 40); got != "queue full: 64 requests waiting (max_queue_size=64); retry with backoff" {
		t.Fatalf("unread requests not counted: %q", got)
	}
	if got := room.refusal(300, 3, 200); got != "queue full: 800 bytes waiting, this request adds 300 (max_queue_bytes=1000); retry with backoff" {
		t.Fatalf("unread bytes not counted: %q", got)
	}
	// Never more than the queue can hold: the worker refuses the unread ones past its bounds.
	if got := room.refusal(1, 9, 40); got != "queue full: 64 requests waiting (max_queue_size=64); retry with backoff" {
		t.Fatalf("unread requests past the bound shown: %q", got)
	}
	big := queueFill{pending: 1, pendingBytes: 1 << 20, maxQueueSize: 64, maxQueueBytes: 600000}
	if got := big.refusal(1<<20, 1, 1<<20); got != "queue full: 1048576 bytes waiting, this request adds 1048576 (max_queue_bytes=600000); retry with backoff" {
		t.Fatalf("unread bytes past the bound shown: %q", got)
	}
	if got := (queueFill{maxQueueSize: 64, maxQueueBytes: 600000}).refusal(1<<20, 1, 1<<20); got != "queue full: 1048576 bytes waiting, this request adds 1048576 (max_queue_bytes=600000); retry with backoff" {
		t.Fatalf("an unread request larger than the bound, into an empty queue: %q", got)
	}
	if got := room.refusal(300, 3, 900); got != "queue full: 1000 bytes waiting, this request adds 300 (max_queue_bytes=1000); retry with backoff" {
		t.Fatalf("unread bytes past the bound shown: %q", got)
	}
	if got := (queueFill{maxQueueSize: 4, maxQueueBytes: 10}).refusal(1<<30, 1, 8); got == "" {
		t.Fatal("a queue empty but for what is on its way refused nothing too large")
	}
}

func TestNoStatusPageRefusesNothing(t *testing.T) {
	page := newStatusPage(filepath.Join(t.TempDir(), "worker.sock"))
	if got := page.refusal(1<<40, 0, 0); got != "" {
		t.Fatalf("refusal without a page = %q", got)
	}
}
