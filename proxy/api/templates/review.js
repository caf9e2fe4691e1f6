// A trajectory page's review shortcuts: the dashboard's only script, allowed by its hash (proxy/api/_pages.py).
// 0-9 set the score to 0.0-0.9 and = (or +) to 1; Enter saves it and opens the next trajectory to review;
// j / k open the next / previous one awaiting a score; n writes a note (Esc leaves it).
(function () {
  var form = document.getElementById("score-form");
  if (!form) return;
  var score = form.elements.namedItem("score");
  var note = form.elements.namedItem("note");
  function open(id) {
    var link = document.getElementById(id);
    if (link) window.location.assign(link.href);
  }
  document.addEventListener("keydown", function (event) {
    if (event.ctrlKey || event.metaKey || event.altKey) return;
    var target = event.target;
    if (target === note || target === score) {
      if (event.key === "Escape") target.blur();
      return; // typing a note, or a score by hand
    }
    if (target && target.closest && target.closest("a, button, select, textarea, input")) return;
    var key = event.key;
    if (key.length === 1 && key >= "0" && key <= "9") score.value = (Number(key) / 10).toFixed(1);
    else if (key === "=" || key === "+") score.value = "1.0";
    else if (key === "Enter") form.requestSubmit();
    else if (key === "j") open("review-next");
    else if (key === "k") open("review-previous");
    else if (key === "n") note.focus();
    else return;
    event.preventDefault();
  });
})();
