// Live refresh of the overview: fetch the partial every refresh_s and swap it in.
// A failed fetch keeps the last view and marks it stale; nothing else runs on the pages.
(function () {
  "use strict";
  var box = document.querySelector("[data-partial]");
  if (!box) { return; }
  var seconds = parseFloat(document.body.getAttribute("data-refresh-s")) || 5;
  function refresh() {
    fetch(box.getAttribute("data-partial"), { credentials: "same-origin", cache: "no-store" })
      .then(function (response) {
        return response.text().then(function (html) {
          box.innerHTML = html;  // server-rendered and escaped, same origin
          box.classList.toggle("stale", !response.ok);
        });
      })
      .catch(function () { box.classList.add("stale"); })
      .then(function () { window.setTimeout(refresh, seconds * 1000); });
  }
  window.setTimeout(refresh, seconds * 1000);
})();
