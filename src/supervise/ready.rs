//! Which of many pollables want polling. A replica may own hundreds of jobs, each with its
//! scheduled runs (a timer, a ledger statement in flight) and, in a burst, a command whose
//! keeper reports; the room wakes for any event of its own (a roster read, a command's
//! report), and polling every job's runs, or every command's reports, at each of those cost
//! more than the work itself with 1,000 jobs. So each is polled with a waker of its own, which
//! marks its key ready and wakes the room, as `FuturesUnordered` does for its futures: only the
//! keys whose timer fired, whose statement answered or whose report came, and those changed
//! from outside since (`mark`), are polled again. The keys: a job's item (`sharded/jobs.rs`),
//! a command's slot (`commands.rs`).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Wake, Waker};

/// What a key must be: ordered, copied into each waker, and sent with it.
pub trait Key: Ord + Clone + Send + Sync + 'static {}

impl<K: Ord + Clone + Send + Sync + 'static> Key for K {}

/// The keys to poll, and each key's waker.
pub struct Ready<K: Key> {
    shared: Arc<Shared<K>>,
    wakers: BTreeMap<K, Waker>,
}

impl<K: Key> Default for Ready<K> {
    fn default() -> Self {
        Ready {
            shared: Arc::new(Shared {
                items: Mutex::new(BTreeSet::new()),
                parent: Mutex::new(None),
            }),
            wakers: BTreeMap::new(),
        }
    }
}

impl<K: Key + Debug> Debug for Ready<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ready").finish_non_exhaustive()
    }
}

struct Shared<K: Key> {
    items: Mutex<BTreeSet<K>>,
    /// The waker of the task that polls the jobs (the room).
    parent: Mutex<Option<Waker>>,
}

/// A key's waker: marks it ready and wakes the room.
struct ItemWaker<K: Key> {
    item: K,
    shared: Arc<Shared<K>>,
}

impl<K: Key> Wake for ItemWaker<K> {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.shared.mark(self.item.clone());
    }
}

impl<K: Key> Shared<K> {
    fn mark(&self, item: K) {
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

impl<K: Key> Ready<K> {
    /// Marks `item` to be polled at the next poll: its runs changed from outside (started,
    /// ended, a request taken, a new clock), or were just made.
    pub fn mark(&self, item: K) {
        self.shared.mark(item);
    }

    /// Marks every one of `items`.
    pub fn mark_all(&self, items: impl Iterator<Item = K>) {
        let mut ready = self
            .shared
            .items
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        ready.extend(items);
    }

    /// Forgets `item`'s waker (the job is no longer owned).
    pub fn forget(&mut self, item: &K) {
        self.wakers.remove(item);
    }

    /// The jobs to poll now, in order, taken from the set (the room's waker kept for the next
    /// wake-up).
    pub fn take(&self, cx: &Context<'_>) -> Vec<K> {
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
    pub fn put_back(&self, items: impl Iterator<Item = K>) {
        self.mark_all(items);
    }

    /// `item`'s waker.
    pub fn waker(&mut self, item: &K) -> Waker {
        let shared = &self.shared;
        self.wakers
            .entry(item.clone())
            .or_insert_with(|| {
                let item = item.clone();
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
        let mut ready = Ready::<u32>::default();
        assert!(ready.take(&cx).is_empty());
        let seven = ready.waker(&7);
        seven.wake_by_ref();
        seven.wake_by_ref();
        ready.waker(&3).wake();
        assert_eq!(room.0.load(std::sync::atomic::Ordering::Relaxed), 2);
        assert_eq!(ready.take(&cx), vec![3, 7]);
        assert!(ready.take(&cx).is_empty());
        ready.put_back([9, 1].into_iter());
        assert_eq!(ready.take(&cx), vec![1, 9]);
    }
}
