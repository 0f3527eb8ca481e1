//! Progress on stderr: one live line (spinner, elapsed time, how many
//! measurements are done and what runs now) above which the measurements
//! are logged as they come.
//!
//! One bar for the whole process, reachable from every benchmark through
//! [`log`], so that no line written while the bar is drawn garbles it. When
//! stderr is not a terminal (CI, a log file) the bar is not drawn and the
//! log lines are written as plain lines.

use std::sync::Mutex;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

static BAR: Mutex<Option<ProgressBar>> = Mutex::new(None);

fn with_bar(f: impl FnOnce(&ProgressBar)) {
    if let Some(bar) = BAR.lock().expect("progress lock").as_ref() {
        f(bar)
    }
}

/// Shows the live line until [`finish`].
pub fn start() {
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {pos} done · {wide_msg}")
            .expect("a valid template"),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    *BAR.lock().expect("progress lock") = Some(bar);
}

/// Says what is measured now.
pub fn task(what: impl Into<String>) {
    let what = what.into();
    with_bar(|b| b.set_message(what.clone()));
    log(format!("== {what}"));
}

/// Relays a line of a child process's stderr: logged indented, and shown
/// on the live line after the running task.
pub fn child_line(task: &str, line: &str) {
    log(format!("   | {line}"));
    with_bar(|b| b.set_message(format!("{task} · {line}")));
}

/// One measurement is done.
pub fn done() {
    with_bar(|b| b.inc(1));
}

/// Writes a line above the live line (or as a plain line without one).
pub fn log(line: impl AsRef<str>) {
    let line = line.as_ref();
    match BAR.lock().expect("progress lock").as_ref() {
        Some(bar) => bar.suspend(|| eprintln!("{line}")),
        None => eprintln!("{line}"),
    }
}

/// Removes the live line.
pub fn finish() {
    if let Some(bar) = BAR.lock().expect("progress lock").take() {
        bar.finish_and_clear();
    }
}
