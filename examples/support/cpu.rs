//! CPU time used by the processes a bench drives, read from `/proc` (Linux; elsewhere
//! all zero): RabbitMQ's VM, Postgres's processes, the bench itself, one process it
//! started (a server under test), and the processes it started and waited for.

/// CPU clock ticks (10 ms each) used so far. Postgres's backends that exited count
/// (their postmaster reaped them), as do this process's children it waited for.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuTicks {
    pub rabbitmq: u64,
    pub postgres: u64,
    /// This process.
    pub this: u64,
    /// The process whose pid [`CpuTicks::now`] was given.
    pub other: u64,
    /// This process's children that it waited for (a bench's workers, once stopped).
    pub children: u64,
}

impl CpuTicks {
    /// The ticks used so far, `other` being the pid of a process the bench started.
    pub fn now(other: Option<u32>) -> Self {
        let mut ticks = CpuTicks::default();
        let me = std::process::id().to_string();
        let other = other.map(|pid| pid.to_string());
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return ticks;
        };
        // Postgres's pids, to tell the postmaster (whose parent is not one of them).
        let mut postgres: Vec<(String, String, u64, u64)> = Vec::new();
        for entry in dir.flatten() {
            let pid = entry.file_name();
            let Some(pid) = pid
                .to_str()
                .filter(|p| p.bytes().all(|b| b.is_ascii_digit()))
            else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // `pid (comm) state ...`: comm may hold spaces, so split at the last ')'.
            let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
                continue;
            };
            let comm = &stat[open + 1..close];
            let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
            // utime and stime are fields 14 and 15 of the line, 12 and 13 after comm;
            // the reaped children's cutime and cstime follow.
            let sum = |range: std::ops::Range<usize>| -> u64 {
                fields
                    .get(range)
                    .map(|f| f.iter().filter_map(|v| v.parse::<u64>().ok()).sum())
                    .unwrap_or(0)
            };
            let (used, reaped) = (sum(11..13), sum(13..15));
            if pid == me {
                ticks.this += used;
                ticks.children += reaped;
            } else if other.as_deref() == Some(pid) {
                ticks.other += used;
            } else if comm.starts_with("beam") {
                ticks.rabbitmq += used + reaped;
            } else if comm.starts_with("postgres") || comm.starts_with("postmaster") {
                let parent = fields.get(1).map_or(String::new(), |p| (*p).to_owned());
                postgres.push((pid.to_owned(), parent, used, reaped));
            }
        }
        for (_, parent, used, reaped) in &postgres {
            ticks.postgres += used;
            if !postgres.iter().any(|(pid, ..)| pid == parent) {
                ticks.postgres += reaped;
            }
        }
        ticks
    }

    /// The ticks used since `self`, in microseconds per operation of `ops`.
    pub fn per_op(self, ops: usize, other: Option<u32>) -> CpuPerOp {
        let now = CpuTicks::now(other);
        let us = |before: u64, after: u64| {
            after.saturating_sub(before) as f64 * 10_000.0 / ops.max(1) as f64
        };
        CpuPerOp {
            rabbitmq: us(self.rabbitmq, now.rabbitmq),
            postgres: us(self.postgres, now.postgres),
            this: us(self.this, now.this),
            other: us(self.other, now.other),
            children: us(self.children, now.children),
        }
    }
}

/// CPU time per operation, in microseconds, as [`CpuTicks`] splits it.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuPerOp {
    pub rabbitmq: f64,
    pub postgres: f64,
    pub this: f64,
    pub other: f64,
    pub children: f64,
}
