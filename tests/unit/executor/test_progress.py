"""The training progress (`trainplan.executor.measure.progress_bar`): plain lines on a stream that is not
a terminal (logs, pipes, CI), a tqdm bar on a terminal, nothing with progress off."""

import io

from trainplan.executor.measure import LogProgress, progress_bar


def _drive(bar, steps: int) -> None:
    """What `trainplan.executor.train.run` does with the bar."""
    for step in range(steps):
        bar.set_postfix(loss=f"{10 - step / 10:.3f}", refresh=False)
        bar.update(1)
    bar.close()


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_not_a_terminal_gets_plain_lines_every_tenth():
    out = io.StringIO()
    bar = progress_bar(100, True, file=out)
    assert isinstance(bar, LogProgress)
    _drive(bar, 100)
    text = out.getvalue()
    lines = text.splitlines()
    assert "\r" not in text
    assert len(lines) == 10  # 10%, 20%, ..., 100%; the last step's line is not repeated by close
    assert lines[0].startswith("train: step 10/100 (10%), loss 9.100, ")
    assert lines[-1].startswith("train: step 100/100 (100%), loss 0.100, ")
    assert all(line.endswith(" s") for line in lines)


def test_not_a_terminal_ends_with_the_last_step_and_counts_from_a_resume():
    out = io.StringIO()
    _drive(progress_bar(40, True, initial=25, file=out), 7)  # stopped early, after step 32
    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == ["train: step 28/40 (70%)",
                                                      "train: step 32/40 (80%)"]


def test_not_a_terminal_also_reports_by_time():
    out = io.StringIO()
    bar = LogProgress(1000, file=out, every_s=0.0)  # every update is due by time
    _drive(bar, 3)
    assert len(out.getvalue().splitlines()) == 3


def test_progress_off_prints_nothing(capsys):
    for stream in (io.StringIO(), _Tty(), None):  # None: stderr
        _drive(progress_bar(50, False, file=stream), 50)
        if stream is not None:
            assert stream.getvalue() == ""
    assert capsys.readouterr() == ("", "")


def test_a_terminal_keeps_the_tqdm_bar():
    out = _Tty()
    bar = progress_bar(20, True, file=out)
    assert not isinstance(bar, LogProgress)
    _drive(bar, 20)
    assert "train" in out.getvalue() and "\r" in out.getvalue()
