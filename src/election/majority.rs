//! The majority rule of a quorum: of `total` servers, more than half must agree. Any two
//! majorities then share a server, which is what keeps a quorum's two leaders, or two claims of
//! one occurrence, from both gathering one.

/// A quorum of `total` servers, reachable or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Majority {
    pub total: usize,
}

impl Majority {
    pub fn of(total: usize) -> Majority {
        Majority { total }
    }

    /// How many servers make a majority: more than half.
    pub fn need(self) -> usize {
        self.total / 2 + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_than_half() {
        let needs: Vec<usize> = (1..=6).map(|total| Majority::of(total).need()).collect();
        assert_eq!(needs, [1, 2, 2, 3, 3, 4]);
    }
}
