//! Giving the allocator's free memory back to the system once a replica holds far fewer items
//! than it did.
//!
//! A replica that starts first takes every job of the crontab, then gives two thirds of them
//! away as the others join: with 1,000 jobs it kept 19 MiB of RSS where its peers, which never
//! held more than their share, kept 13. glibc's allocator returns freed memory to the system
//! only from the top of its heap; what the given jobs freed lies in between, among what the
//! kept ones still use, and stays resident (a heap that held 1,000 jobs' state). `malloc_trim`
//! releases those free pages (it went to 13.5 MiB when called from a debugger). It walks the
//! heap, so it is called only when the items held fell to half of what they were since the
//! last call, never at each hand-over of a few.

/// The most items held since the heap was last given back.
#[derive(Debug, Default)]
pub struct Trim {
    peak: usize,
}

/// Below this many items held at the peak, what they leave is not worth a walk of the heap.
const WORTH_IT: usize = 64;

impl Trim {
    /// The replica now holds `held` items: gives the heap's free memory back if that is half
    /// or less of what it held at the most since the last time.
    pub fn held(&mut self, held: usize) {
        self.peak = self.peak.max(held);
        if self.peak >= WORTH_IT && held * 2 <= self.peak {
            give_back();
            self.peak = held;
        }
    }
}

/// Returns the allocator's free pages to the system.
fn give_back() {
    // SAFETY: malloc_trim only walks the allocator's own free lists; it takes the allocator's
    // lock as malloc does, and touches no memory the program owns.
    #[cfg(target_env = "gnu")]
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_heap_is_given_back_once_the_items_held_halve() {
        let mut trim = Trim::default();
        trim.held(1000);
        trim.held(600);
        assert_eq!(trim.peak, 1000, "600 of 1,000 is more than half");
        trim.held(334);
        assert_eq!(trim.peak, 334, "given back, counting from what is held now");
        trim.held(200);
        assert_eq!(trim.peak, 334);
        trim.held(10);
        assert_eq!(trim.peak, 10);
        // Few items: not worth a walk of the heap.
        trim.held(40);
        trim.held(0);
        assert_eq!(trim.peak, 40);
    }
}
