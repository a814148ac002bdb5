//! Which owned jobs' runs want polling. A replica may own hundreds of jobs, each with its
//! scheduled runs (a timer, a ledger statement in flight); the room wakes for any event of its
//! own (a roster read, a command's report), and polling every job's runs at each of those cost
//! more than the work itself with 1,000 jobs at rest. So each job's runs are polled with a
//! waker of their own, which marks the job ready and wakes the room, as `FuturesUnordered`
//! does for its futures: only the jobs whose timer fired or whose statement answered, and
//! those changed from outside since (`mark`), are polled again.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Wake, Waker};

/// The jobs to poll, and each job's waker.
#[derive(Default)]
pub struct Ready {
    shared: Arc<Shared>,
    wakers: BTreeMap<u32, Waker>,
}

#[derive(Default)]
struct Shared {
    items: Mutex<BTreeSet<u32>>,
    /// The waker of the task that polls the jobs (the room).
    parent: Mutex<Option<Waker>>,
}

/// A job's waker: marks it ready and wakes the room.
struct ItemWaker {
    item: u32,
    shared: Arc<Shared>,
}

impl Wake for ItemWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.shared.mark(self.item);
    }
}

impl Shared {
    fn mark(&self, item: u32) {
        let inserted = self
            .items
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(item);
        if inserted {
            let parent = self.parent.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(parent) = parent.as_ref() {
                parent.wake_by_ref();
            }
        }
    }
}

impl Ready {
    /// Marks `item` to be polled at the next poll: its runs changed from outside (started,
    /// ended, a request taken, a new clock), or were just made.
    pub fn mark(&self, item: u32) {
        self.shared.mark(item);
    }

    /// Marks every one of `items`.
    pub fn mark_all(&self, items: impl Iterator<Item = u32>) {
        let mut ready = self
            .shared
            .items
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        ready.extend(items);
    }

    /// Forgets `item`'s waker (the job is no longer owned).
    pub fn forget(&mut self, item: u32) {
        self.wakers.remove(&item);
    }

    /// The jobs to poll now, in order, taken from the set (the room's waker kept for the next
    /// wake-up).
    pub fn take(&self, cx: &Context<'_>) -> Vec<u32> {
        {
            let mut parent = self
                .shared
                .parent
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if !parent.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                *parent = Some(cx.waker().clone());
            }
        }
        let mut items = self
            .shared
            .items
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        std::mem::take(&mut *items).into_iter().collect()
    }

    /// Puts back jobs that were taken and not polled (an earlier one had something to say).
    pub fn put_back(&self, items: impl Iterator<Item = u32>) {
        self.mark_all(items);
    }

    /// `item`'s waker.
    pub fn waker(&mut self, item: u32) -> Waker {
        let shared = &self.shared;
        self.wakers
            .entry(item)
            .or_insert_with(|| {
                Waker::from(Arc::new(ItemWaker {
                    item,
                    shared: Arc::clone(shared),
                }))
            })
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_s_waker_marks_it_and_wakes_the_room_once() {
        struct Count(std::sync::atomic::AtomicUsize);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let room = Arc::new(Count(0.into()));
        let waker = Waker::from(Arc::clone(&room));
        let cx = Context::from_waker(&waker);
        let mut ready = Ready::default();
        assert!(ready.take(&cx).is_empty());
        let seven = ready.waker(7);
        seven.wake_by_ref();
        seven.wake_by_ref();
        ready.waker(3).wake();
        assert_eq!(room.0.load(std::sync::atomic::Ordering::Relaxed), 2);
        assert_eq!(ready.take(&cx), vec![3, 7]);
        assert!(ready.take(&cx).is_empty());
        ready.put_back([9, 1].into_iter());
        assert_eq!(ready.take(&cx), vec![1, 9]);
    }
}
