//! The child processes of one run: a `kvbm-mocker` fleet and a `kvbm-router` in front of it.

use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// A child process, stopped (SIGTERM, then SIGKILL after a grace period) when dropped.
#[derive(Debug)]
pub struct Process {
    pub name: &'static str,
    child: Child,
    pub log: PathBuf,
}

impl Process {
    /// Starts `command`, its stdout and stderr into `log`.
    pub fn spawn(name: &'static str, mut command: Command, log: PathBuf) -> anyhow::Result<Self> {
        let out =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        // SAFETY: the closure runs in the child between fork and exec and only calls prctl(2),
        // which is async-signal-safe: the child gets SIGTERM if this process dies first.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting {name} ({:?})", command.get_program()))?;
        Ok(Self { name, child, log })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// An error if the process has exited, with the end of its log.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!("{} exited ({status}); {}", self.name, self.log_tail());
        }
        Ok(())
    }

    /// The last lines of the process's log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(15)..].join("\n");
        format!("the end of its log ({}):\n{tail}", self.log.display())
    }

    /// CPU seconds (user + system) the process has used so far.
    pub fn cpu_s(&self) -> Option<f64> {
        cpu_seconds(&format!("/proc/{}/stat", self.pid()))
    }

    /// CPU seconds (user, system) the process has used so far.
    pub fn cpu_split_s(&self) -> Option<CpuSplit> {
        cpu_split_seconds(&format!("/proc/{}/stat", self.pid()))
    }

    /// CPU seconds (user, system) its live threads whose names start with one of `prefixes`
    /// have used.
    pub fn threads_cpu_split_s(&self, prefixes: &[&str]) -> Option<CpuSplit> {
        let dir = format!("/proc/{}/task", self.pid());
        let mut total = CpuSplit::default();
        for entry in std::fs::read_dir(&dir).ok()?.flatten() {
            let task = entry.path();
            let Ok(comm) = std::fs::read_to_string(task.join("comm")) else {
                continue;
            };
            if prefixes.iter().any(|p| comm.starts_with(p)) {
                let c = cpu_split_seconds(&task.join("stat").to_string_lossy()).unwrap_or_default();
                total.user += c.user;
                total.system += c.system;
            }
        }
        Some(total)
    }

    /// SIGTERM, up to `grace` for it to exit, then SIGKILL.
    pub fn stop(&mut self, grace: Duration) {
        if self.child.try_wait().ok().flatten().is_some() {
            return;
        }
        // SAFETY: kill(2) on our own child's pid, which try_wait has not reaped.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let until = Instant::now() + grace;
        while Instant::now() < until {
            if self.child.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(5));
    }
}

/// CPU seconds in user space and in the kernel.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CpuSplit {
    pub user: f64,
    pub system: f64,
}

impl CpuSplit {
    pub fn total(&self) -> f64 {
        self.user + self.system
    }
}

/// utime + stime of `/proc/PID/stat` (or `/proc/self/stat`), in seconds.
pub fn cpu_seconds(stat_path: &str) -> Option<f64> {
    cpu_split_seconds(stat_path).map(|c| c.total())
}

/// utime and stime of `/proc/PID/stat` (or a thread's `/proc/PID/task/TID/stat`), in seconds.
pub fn cpu_split_seconds(stat_path: &str) -> Option<CpuSplit> {
    parse_cpu_split(&std::fs::read_to_string(stat_path).ok()?)
}

/// utime and stime of a `stat` file's text, in seconds.
fn parse_cpu_split(text: &str) -> Option<CpuSplit> {
    // Fields after the command name (which may hold spaces) start at field 3 (state):
    // utime and stime are fields 14 and 15 (proc(5)).
    let rest = &text[text.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    // SAFETY: sysconf reads a constant of the system.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = if hz > 0 { hz as f64 } else { 100.0 };
    Some(CpuSplit {
        user: utime as f64 / hz,
        system: stime as f64 / hz,
    })
}

/// Waits for the mocker's ready file; returns its lines (one worker each, `--workers` syntax).
pub async fn wait_ready_file(
    mocker: &mut Process,
    path: &Path,
    workers: usize,
    timeout: Duration,
) -> anyhow::Result<Vec<String>> {
    let until = Instant::now() + timeout;
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            let lines: Vec<String> = text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(str::to_owned)
                .collect();
            if lines.len() == workers {
                return Ok(lines);
            }
            bail!(
                "the mocker's ready file lists {} workers, not {workers}:\n{text}",
                lines.len()
            );
        }
        mocker.check_alive()?;
        if Instant::now() > until {
            bail!(
                "the mocker was not ready within {timeout:?}; {}",
                mocker.log_tail()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `http=` address of a worker line.
pub fn worker_http(line: &str) -> anyhow::Result<String> {
    line.split(',')
        .find_map(|f| f.strip_prefix("http="))
        .map(|s| s.trim_end_matches('/').to_owned())
        .with_context(|| format!("the worker line {line:?} has no http= address"))
}

/// A free TCP port on 127.0.0.1 (bound, then released for the child to take).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A value of a Prometheus text exposition: the sum of the samples named `name` whose labels
/// include `label` (all of them when `None`).
pub fn prom_sum(text: &str, name: &str, label: Option<(&str, &str)>) -> f64 {
    let mut sum = 0.0;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (labels, value) = if let Some(inner) = rest.strip_prefix('{') {
            let Some(close) = inner.rfind('}') else {
                continue;
            };
            (&inner[..close], inner[close + 1..].trim())
        } else if rest.starts_with(' ') {
            ("", rest.trim())
        } else {
            continue; // another metric whose name starts with `name`
        };
        if let Some((key, want)) = label {
            let found = labels.split(',').any(|pair| {
                pair.split_once('=')
                    .is_some_and(|(k, v)| k.trim() == key && v.trim().trim_matches('"') == want)
            });
            if !found {
                continue;
            }
        }
        if let Some(v) = value
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            sum += v;
        }
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_samples_are_summed_by_label() {
        let text = "# HELP kvbm_mocker_prompt_tokens_total prompt tokens\n\
                    # TYPE kvbm_mocker_prompt_tokens_total counter\n\
                    kvbm_mocker_prompt_tokens_total{source=\"computed\"} 100\n\
                    kvbm_mocker_prompt_tokens_total{worker=\"1\",source=\"gpu\"} 28\n\
                    kvbm_mocker_prompt_tokens_total_extra{source=\"gpu\"} 5\n\
                    kvbm_mocker_requests_total{outcome=\"finished\"} 3\n\
                    kvbm_mocker_requests_total{outcome=\"aborted\"} 1\n\
                    kvbm_mocker_sim_seconds 12.5\n";
        let p = "kvbm_mocker_prompt_tokens_total";
        assert_eq!(prom_sum(text, p, Some(("source", "computed"))), 100.0);
        assert_eq!(prom_sum(text, p, Some(("source", "gpu"))), 28.0);
        assert_eq!(prom_sum(text, p, Some(("source", "disk"))), 0.0);
        assert_eq!(prom_sum(text, p, None), 128.0);
        assert_eq!(prom_sum(text, "kvbm_mocker_requests_total", None), 4.0);
        assert_eq!(prom_sum(text, "kvbm_mocker_sim_seconds", None), 12.5);
    }

    #[test]
    fn worker_lines_give_their_http_address() {
        let line = "3=tcp://127.0.0.1:5000,replay=tcp://127.0.0.1:5001,http=http://127.0.0.1:8003";
        assert_eq!(worker_http(line).unwrap(), "http://127.0.0.1:8003");
        assert!(worker_http("3=tcp://127.0.0.1:5000").is_err());
    }

    #[test]
    fn own_cpu_time_is_readable() {
        assert!(cpu_seconds("/proc/self/stat").is_some_and(|s| s >= 0.0));
    }

    #[test]
    fn user_and_system_time_are_fields_14_and_15_after_any_command_name() {
        // A command name with a space and a parenthesis, utime 250 and stime 150 ticks.
        let text = "4242 (tokio rt) x) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 150 0 0 20 0 8 0";
        // SAFETY: sysconf reads a constant of the system.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        let c = parse_cpu_split(text).unwrap();
        assert_eq!((c.user * hz, c.system * hz), (250.0, 150.0));
        assert_eq!(c.total() * hz, 400.0);
        assert!(parse_cpu_split("4242 (cut short) S 1 2").is_none());
        assert!(parse_cpu_split("no parenthesis").is_none());
    }
}
